"""Train several configs inside one process group and write each run's metrics to JSON.

Launched by the parity tests under torchrun (one launch per world size), because starting
a process group costs far more on a 2-core CI machine than the few steps each run trains.
Usage: parity_driver.py OUT.json BASE_ARGS... -- RUN_ARGS... -- RUN_ARGS...
Besides OUT.json, OUT.json.cache.json holds each run's compile-cache hit and miss counts, and
with WEFT_RECORD_GRAPHS=1 each run's folder holds compiled_graphs.json (tests/graph_inspection.py).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.graph_inspection import record_compiled_graphs  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.main import prepare  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def _cache_counters() -> dict[str, int]:
    """Cumulative AOTAutograd and FX graph cache hits/misses of this process (Dynamo's counters)."""
    counters = torch._dynamo.utils.counters
    return {**counters["aot_autograd"], **{k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}}


def main() -> None:
    out_path, *rest = sys.argv[1:]
    groups, current = [], []
    for arg in rest:
        if arg == "--":
            groups.append(current)
            current = []
        else:
            current.append(arg)
    groups.append(current)
    base, runs = groups[0], groups[1:]
    dist.init_process_group("gloo")
    results, cache_stats = {}, {}
    for index, run in enumerate(runs):
        cfg = load_config(base + run + ["--job.dump_folder", f"{out_path}.run{index}"])
        tokenizer, model_args, dims = prepare(cfg, dist.get_world_size())
        torch.manual_seed(cfg.training.seed)
        before = _cache_counters()
        trainer = Trainer(cfg, tokenizer=tokenizer, model_args=model_args, dims=dims, device=torch.device("cpu"))
        recorded = None
        if os.environ.get("WEFT_RECORD_GRAPHS") == "1" and dist.get_rank() == 0:
            recorded = record_compiled_graphs(os.path.join(cfg.job.dump_folder, "compiled_graphs.json"))
        trainer.train()
        if recorded is not None:
            torch._inductor.config.post_grad_custom_post_pass = recorded
        trainer.close()
        # Each run is a separate training job: drop compiled code that captured the previous
        # run's process groups and meshes.
        torch._dynamo.reset()
        cache_stats[" ".join(run)] = {k: v - before.get(k, 0) for k, v in _cache_counters().items()}
        if dist.get_rank() == 0:
            with open(os.path.join(cfg.job.dump_folder, "metrics.jsonl")) as f:
                results[" ".join(run)] = [json.loads(line) for line in f]
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
        with open(f"{out_path}.cache.json", "w") as f:
            json.dump(cache_stats, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
