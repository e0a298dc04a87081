"""What a user sees in the console of a 2-rank run: checkpoint saves and the resume, once each,
from rank 0, with timestamps; the other rank stays quiet below WARNING."""

import re

from tests.dist_utils import torchrun_train

ARGS = ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "tinymodel",
        "--training.seq_len", "32", "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "2",
        "--lr_scheduler.warmup_steps", "1"]


def test_saves_and_resume_are_logged_once_by_rank_0(tmp_path, corpus):
    common = [*ARGS, "--training.dataset_path", corpus, "--job.dump_folder", str(tmp_path / "run")]
    first = torchrun_train(2, *common, "--training.steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = torchrun_train(2, *common, "--training.steps", "3")
    assert second.returncode == 0, second.stderr[-3000:]

    saved = [line for line in first.stdout.splitlines() if "checkpoint step 2 saved" in line]
    assert len(saved) == 1 and re.match(r"\[weft\] \d\d:\d\d:\d\d checkpoint step 2 saved to ", saved[0]), first.stdout
    console = second.stdout + second.stderr
    resumed = [line for line in console.splitlines() if "resumed from checkpoint step 2" in line]
    assert len(resumed) == 1 and resumed[0].startswith("[weft] "), console
    assert len([line for line in console.splitlines() if "checkpoint step 3 saved" in line]) == 1
    assert "[weft rank1]" not in console  # rank 1 logs warnings only, and there were none
