"""The real-run side of the planner's checks, under torchrun with 4 CPU processes (gloo).

One launch serves tests/test_memory_estimate.py and tests/test_comm.py, because starting a
process group costs far more on a 2-core CI machine than the checks do:
1. For each config (after `--`): build the real Trainer, record every process group's timeout,
   train one step (which switches to the train timeout), record again, then run one more
   forward/backward and optimizer step without zeroing, and sum this rank's bytes of
   parameter shards, gradient shards and optimizer state.
2. On a (2, 2) mesh, run one tensor-parallel Llama block per checkpointing kind, with sequence
   parallel on and off: the bytes it keeps for backward, and the count (models/llama3/memory.py).
3. Rank 0 alone issues an all-reduce after the timeout was set to 2 s: it must fail, not hang.
Usage: planner_driver.py OUT.json BASE_ARGS... -- CONFIG_ARGS... -- CONFIG_ARGS...
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from models.llama3.args import ModelArgs  # noqa: E402
from models.llama3.memory import check_block  # noqa: E402
from tests.dist_utils import exit_without_finalizing, split_driver_args  # noqa: E402
from trainer.comm import init_process_group, set_timeout  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.run import resolve_run  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

BLOCK_ARGS = ModelArgs(dim=384, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim_multiplier=1.0, multiple_of=256,
                       vocab_size=512, max_seq_len=512)
BLOCK_TOKENS = 256


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _timeouts(trainer: Trainer) -> list[float]:
    groups = [dist.group.WORLD, *trainer.meshes.process_groups()]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def real_state(argv: list[str]) -> dict:
    run = resolve_run(load_config(argv), dist.get_world_size())
    torch.manual_seed(run.cfg.training.seed)
    trainer = Trainer(run)
    init_timeouts = _timeouts(trainer)
    trainer.train()
    train_timeouts = _timeouts(trainer)
    for inputs, labels in trainer.dataloader.next_step():
        with trainer._loss_context():
            trainer.loss_fn(trainer.model(inputs), labels).backward()
    trainer.optimizer.step()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    result = {
        "params": _local_bytes(params),
        "grads": _local_bytes(p.grad for p in params),
        "optimizer": _local_bytes(state),
        "init_timeouts": init_timeouts,
        "train_timeouts": train_timeouts,
    }
    trainer.close()
    return result


def block_activations() -> dict:
    """(measured, counted) bytes one tensor-parallel (tp = 2) block keeps for backward, eager, per kind."""
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    return {f"{kind} sp={sp}": check_block(BLOCK_ARGS, kind, BLOCK_TOKENS, tp_mesh=tp_mesh, sequence_parallel=sp)
            for sp in (True, False) for kind in ("none", "full", "op", "op_all")}


def timeout_fires() -> dict:
    """Rank 0 issues a collective the others, alive but busy for 10 s, do not join; with a 2 s
    timeout it must raise, not hang."""
    set_timeout(2, [])
    if dist.get_rank() != 0:
        time.sleep(10)
        return {}
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        return {"raised": True, "seconds": time.monotonic() - start, "error": str(e)[:200]}
    return {"raised": False, "seconds": time.monotonic() - start}


def main() -> None:
    out_path, base, configs = split_driver_args(sys.argv[1:])
    first = load_config(base + ["--job.dump_folder", f"{out_path}.init"])
    init_process_group(torch.device("cpu"), first.comm, f"{out_path}.traces")
    rank = dist.get_rank()
    result = {"states": {}}
    for index, config in enumerate(configs):
        state = real_state(base + config + ["--job.dump_folder", f"{out_path}.run{index}"])
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, state)
        result["states"][" ".join(config)] = gathered
    result["activations"] = block_activations()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    result["timeout"] = timeout_fires()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    exit_without_finalizing()


if __name__ == "__main__":
    main()
