"""Train several configs inside one process group and write each run's metrics to JSON,
plus, under "batches RUN", a hash of each step's global batch.

Launched by the parity tests under torchrun (one launch per world size), because starting
a process group costs far more on a 2-core CI machine than the few steps each run trains.
Usage: parity_driver.py OUT.json BASE_ARGS... -- RUN_ARGS... -- RUN_ARGS...
A run whose args include `--count-comms` also records, per step, the collectives its
`train_step` issued (keyed by op name, e.g. "c10d._reduce_scatter_base_") under "<run args>#comms".
With `--offload-all-sizes`, activation offload moves storages of any size (the tiny model's are
far below its 1 MiB floor).
Besides OUT.json, OUT.json.cache.json holds each run's compile-cache hit and miss counts, and
with WEFT_RECORD_GRAPHS=1 each run's folder holds compiled_graphs.json (tests/graph_inspection.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tests.dist_utils import exit_without_finalizing, split_driver_args  # noqa: E402
from tests.graph_inspection import record_compiled_graphs  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.run import resolve_run  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


class CountCollectives(TorchDispatchMode):
    """Counts c10d and functional-collective ops. (torch's CommDebugMode counts the same ops but its
    module tracker fails on a second forward inside one context, torch 2.13.)"""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = f"{func.namespace}.{func._opname}"
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def record_global_batches(trainer: Trainer) -> dict[int, list]:
    """Wrap the loader so each step's input rows are kept: {step: [this rank's rows]}."""
    rows: dict[int, list] = {}
    next_step = trainer.dataloader.next_step

    def recording():
        micro = next_step()
        rows[trainer.step] = torch.cat([inputs for inputs, _ in micro]).tolist()
        return micro

    trainer.dataloader.next_step = recording
    return rows


def global_batch_hashes(trainer: Trainer, rows: dict[int, list]) -> dict[int, str] | None:
    """On rank 0: {step: sha of the step's global batch}, rows of dp ranks in dp order (the
    same for any dp and local batch size when the loader is mesh-independent)."""
    gathered = [None] * dist.get_world_size()
    tp_rank = trainer.meshes.tp.get_local_rank()
    dist.all_gather_object(gathered, (trainer.dp_rank, tp_rank, rows))
    if dist.get_rank() != 0:
        return None
    by_dp = sorted((dp, r) for dp, tp, r in gathered if tp == 0)
    return {step: hashlib.sha256(json.dumps([row for _, r in by_dp for row in r[step]]).encode()).hexdigest()[:16]
            for step in sorted(rows)}


def _cache_counters() -> dict[str, int]:
    """Cumulative AOTAutograd and FX graph cache hits/misses of this process (Dynamo's counters)."""
    counters = torch._dynamo.utils.counters
    return {**counters["aot_autograd"], **{k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}}


def main() -> None:
    out_path, base, runs = split_driver_args(sys.argv[1:])
    # A rank killed by a signal prints every thread's C++ stack (the crash may be in a gloo
    # thread, which faulthandler's Python stacks do not show). Private torch API, checked on 2.13.
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    dist.init_process_group("gloo")
    results, cache_stats = {}, {}
    for index, run in enumerate(runs):
        if dist.get_rank() == 0:
            print(f"parity_driver: run {index + 1}/{len(runs)}: {' '.join(run)}", flush=True)
        count = "--count-comms" in run
        flags = ("--count-comms", "--offload-all-sizes")
        cfg = load_config(base + [a for a in run if a not in flags] + ["--job.dump_folder", f"{out_path}.run{index}"])
        resolved = resolve_run(cfg, dist.get_world_size())
        torch.manual_seed(cfg.training.seed)
        before = _cache_counters()
        trainer = Trainer(resolved)
        if "--offload-all-sizes" in run:
            trainer.activation_offload.min_bytes = 0
        comms = []
        if count:
            step = trainer.train_step

            def counted(batches):
                with CountCollectives() as mode:
                    out = step(batches)
                comms.append(mode.counts)
                return out

            trainer.train_step = counted
        rows = record_global_batches(trainer)
        recorded = None
        if os.environ.get("WEFT_RECORD_GRAPHS") == "1" and dist.get_rank() == 0:
            recorded = record_compiled_graphs(os.path.join(cfg.job.dump_folder, "compiled_graphs.json"))
        trainer.train()
        if recorded is not None:
            torch._inductor.config.post_grad_custom_post_pass = recorded
        trainer.close()
        hashes = global_batch_hashes(trainer, rows)
        # Each run is a separate training job: drop compiled code that captured the previous
        # run's process groups and meshes.
        torch._dynamo.reset()
        cache_stats[" ".join(run)] = {k: v - before.get(k, 0) for k, v in _cache_counters().items()}
        if dist.get_rank() == 0:
            with open(os.path.join(cfg.job.dump_folder, "metrics.jsonl")) as f:
                results[" ".join(run)] = [json.loads(line) for line in f]
            if count:
                results[" ".join(run) + "#comms"] = comms
            results["batches " + " ".join(run)] = hashes
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
        with open(f"{out_path}.cache.json", "w") as f:
            json.dump(cache_stats, f)
    dist.destroy_process_group()
    exit_without_finalizing()


if __name__ == "__main__":
    main()
