"""What the checkpoint's integrity work costs: the manifest and the NaN/Inf check, against the save.

Builds a Llama 3 flavor (fp32 weights + AdamW state, as the trainer holds them) on one device,
saves it a few times through CheckpointManager into `--folder`, and prints per save: the whole
save, the manifest (crc32 of every file, written before the rename), the NaN/Inf check, and
their share of the save; then the verify time of a resume. It also checks that the NaN/Inf
check catches NaN and Inf on this device and lets huge finite values through.

    python scripts/time_checkpoint.py --folder /data/ckpt_timing --flavor 1B [--async] [--saves 3]

The 1B flavor is ~15 GB of weights + Adam state: put `--folder` on the disk checkpoints
will use, with room for two of them (keep_latest_k = 1 deletes the older after each save).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import get_model_spec  # noqa: E402
from trainer import checkpoint_manifest as manifest  # noqa: E402
from trainer.checkpoint import CheckpointManager, step_dir  # noqa: E402
from trainer.errors import NonFiniteError  # noqa: E402
from trainer.config import Checkpoint  # noqa: E402


def crc32_throughput() -> float:
    """GB/s of zlib.crc32 on one core over a 64 MiB buffer."""
    import zlib

    buffer = os.urandom(manifest.CHUNK_BYTES)
    zlib.crc32(buffer)
    start = time.perf_counter()
    for _ in range(4):
        zlib.crc32(buffer)
    return 4 * len(buffer) / (time.perf_counter() - start) / 1e9


def check_nonfinite_detection(mgr: CheckpointManager, device: torch.device) -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(1 << 20, device=device)
        t[12345] = bad
        try:
            mgr._check_finite(0, {"w": t})
        except NonFiniteError:
            continue
        raise SystemExit(f"FAIL: a {bad} weight on {device} was not caught")
    mgr._check_finite(0, {"w": torch.full((1 << 20,), 3e38, device=device)})  # finite: must pass
    print(f"NaN/Inf check on {device}: catches nan, inf, -inf; passes 3e38")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", required=True, help="dump folder on the checkpoint disk (its 'ckpt' sub-folder is removed at the end)")
    p.add_argument("--flavor", default="1B")
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--async", dest="is_async", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(a.folder, exist_ok=True)
    store = os.path.join(os.path.abspath(a.folder), "timing.store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    spec = get_model_spec("llama3")
    with torch.device(device):
        model = spec.model_cls(spec.build_args(a.flavor, vocab_size=a.vocab_size, max_seq_len=8192))
    params = list(model.parameters())
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    optimizer.step()  # creates exp_avg / exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state_gb = sum(p.numel() * p.element_size() * 3 for p in params) / 1e9
    cfg = Checkpoint(enable=True, folder="ckpt", keep_latest_k=1, async_mode="async" if a.is_async else "disabled")
    mgr = CheckpointManager(cfg, dump_folder=a.folder, model=model, optimizer=optimizer, lr_scheduler=scheduler,
                            dataloader=None)
    print(f"{a.flavor}: {sum(p.numel() for p in params) / 1e9:.2f}B params, {state_gb:.1f} GB weights + Adam state; "
          f"crc32 {crc32_throughput():.2f} GB/s per core, {manifest.default_threads()} threads; torch {torch.__version__}")
    check_nonfinite_detection(mgr, device)

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    for step in range(1, a.saves + 1):
        start = time.perf_counter()
        mgr._check_finite(step, get_model_state_dict(model))
        check = time.perf_counter() - start
        start = time.perf_counter()
        mgr.save(step)
        blocked = time.perf_counter() - start
        mgr.wait()
        total = time.perf_counter() - start
        folder = step_dir(mgr.folder, step)
        files = manifest.list_files(folder)
        start = time.perf_counter()
        manifest.checksum(folder, list(files))  # what the save did, again, on the same page-cached files
        sealed = time.perf_counter() - start
        size = sum(files.values()) / 1e9
        base = total - sealed - check
        print(f"save {step}: {size:.1f} GB in {total:.2f}s (training blocked {blocked:.2f}s); manifest {sealed:.2f}s "
              f"({size / sealed:.1f} GB/s), NaN/Inf check {check * 1e3:.1f} ms: overhead {100 * (sealed + check) / base:.1f}% "
              "of the save without them")

    start = time.perf_counter()
    problems = manifest.compare(folder, manifest.read(folder))
    print(f"verify on resume (files page-cached): {time.perf_counter() - start:.2f}s ({'ok' if not problems else problems})")
    mgr.close()
    shutil.rmtree(mgr.folder, ignore_errors=True)
    dist.destroy_process_group()
    if os.path.exists(store):
        os.remove(store)


if __name__ == "__main__":
    main()
