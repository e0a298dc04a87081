"""Train several configs inside one process group and write each run's metrics to JSON.

Launched by the parity tests under torchrun (one launch per world size), because starting
a process group costs far more on a 2-core CI machine than the few steps each run trains.
Usage: parity_driver.py OUT.json BASE_ARGS... -- RUN_ARGS... -- RUN_ARGS...
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.dist_utils import split_driver_args  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.run import resolve_run  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def main() -> None:
    out_path, base, runs = split_driver_args(sys.argv[1:])
    dist.init_process_group("gloo")
    results = {}
    for index, run in enumerate(runs):
        cfg = load_config(base + run + ["--job.dump_folder", f"{out_path}.run{index}"])
        resolved = resolve_run(cfg, dist.get_world_size())
        torch.manual_seed(cfg.training.seed)
        trainer = Trainer(resolved)
        trainer.train()
        trainer.close()
        # Each run is a separate training job: drop compiled code that captured the previous
        # run's process groups and meshes.
        torch._dynamo.reset()
        if dist.get_rank() == 0:
            with open(os.path.join(cfg.job.dump_folder, "metrics.jsonl")) as f:
                results[" ".join(run)] = [json.loads(line) for line in f]
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
