"""StepReadout: a logged step's device values, staged without a sync and taken a step later."""

import pytest
import torch

from trainer.step_readout import StepReadout


def test_take_gives_the_values_as_staged_with_their_context():
    readout = StepReadout(torch.device("cpu"))
    assert readout.take() is None
    loss = torch.tensor(2.5)
    readout.stage([loss, torch.tensor(0.75, dtype=torch.float64), torch.tensor(7)], context="step 3")
    loss += 100.0  # the training loop goes on: what was staged is a copy
    values, context = readout.take()
    assert values == [2.5, 0.75, 7.0] and context == "step 3"
    assert readout.take() is None


def test_values_keep_full_precision_and_non_finite_values():
    readout = StepReadout(torch.device("cpu"))
    readout.stage([torch.tensor(1 / 3, dtype=torch.float64), torch.tensor(float("nan")), torch.tensor(2**40)], None)
    (third, nan, big), _ = readout.take()
    assert third == 1 / 3 and nan != nan and big == 2**40


def test_staging_twice_without_taking_is_an_error():
    readout = StepReadout(torch.device("cpu"))
    readout.stage([torch.tensor(1.0)], 1)
    with pytest.raises(RuntimeError, match="not taken"):
        readout.stage([torch.tensor(2.0)], 2)
    assert readout.take() == ([1.0], 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_values_are_read_after_the_queued_work():
    readout = StepReadout(torch.device("cuda"))
    x = torch.ones(4096, 4096, device="cuda")
    for _ in range(20):  # keep the GPU busy past the stage call
        x = x @ x / 4096
    readout.stage([x.sum(), x.mean()], "late")
    (total, mean), context = readout.take()
    assert total == pytest.approx(4096 * 4096) and mean == pytest.approx(1.0) and context == "late"


def test_deferred_only_where_the_device_runs_behind_the_host():
    assert not StepReadout(torch.device("cpu")).deferred
    if torch.cuda.is_available():
        assert StepReadout(torch.device("cuda")).deferred


def _record_when_steps_are_logged(rank, world_size, dump, corpus, out):
    import json

    from tests.test_training_resume import RESUME
    from trainer.config import load_config
    from trainer.metrics import MetricsLogger
    from trainer.run import resolve_run
    from trainer.trainer import Trainer

    cfg = load_config(RESUME + ["--training.dataset_path", corpus, "--training.steps", "4", "--metrics.log_freq", "1",
                                "--checkpoint.interval", "2", "--job.dump_folder", dump])
    trainer = Trainer(resolve_run(cfg, world_size))
    when = []  # (the step a record is for, the trainer's step when it is logged)
    log = MetricsLogger.log

    def recording_log(self, window, **kwargs):
        when.append((window.step, trainer.step))
        return log(self, window, **kwargs)

    MetricsLogger.log = recording_log  # this rank's process only
    trainer.train()
    trainer.close()
    with open(out, "w") as f:
        json.dump(when, f)


def test_on_a_cpu_the_trainer_logs_each_step_in_its_own_iteration(tmp_path, corpus):
    """A CPU runs each op as it is called: a record read a step late would time the next
    step's work into its window. So each logged step is logged before the next step begins."""
    import json

    from tests.dist_utils import run_distributed

    out = tmp_path / "when.json"
    run_distributed(_record_when_steps_are_logged, 1, str(tmp_path / "run"), corpus, str(out))
    assert json.loads(out.read_text()) == [[1, 1], [2, 2], [3, 3], [4, 4]]
