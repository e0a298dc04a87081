"""Data-parallel paths that need no training run: dp = 1 numerics, and the graph engine's layout.

dp = 1 without a data-parallel wrapper matches FSDP2 on a one-rank mesh, step for step.

One process trains the tiny model (512-row vocabulary) for 3 AdamW steps twice from the same
weights and batches: once under `fully_shard` on a 1-rank mesh (the former single-GPU path),
once with parameters left as fp32 masters cast at use (`apply_compute_dtype`). Both in fp32
and in bf16 compute (fp32 master weights, fp32 reduce) the losses and gradient norms agree
within 1e-5 relative. Measured on torch 2.13 CPU: bitwise equal in fp32; in bf16 within 2e-6
(loss) and 5e-6 (grad norm), because the dp = 1 path looks the embedding up in fp32 and sums
the rows that share a token in fp32, where FSDP2 sums them in bf16 (bitwise equal before that
change, since everything else runs bf16 forward/backward and turns the bf16 gradient into
fp32). (With FSDP2's default
`cast_forward_inputs=True`, which parallel/fsdp.py turns off, FSDP2 also rounds the fp32 RoPE
table passed to each block to bf16: losses then differ by up to 4e-5 relative.)
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import ROOT, run_distributed

STEPS = 3


def _train(param_dtype, wrap):
    from models.llama3.args import flavor_args
    from models.llama3.model import Transformer
    from parallel.grad_clip import clip_grad_norm_
    from parallel.init import sharded_init_normal_
    from parallel.mesh import ParallelDims
    from parallel.parameter_views import stored_parameters

    args = flavor_args("tinymodel", vocab_size=512, max_seq_len=32)
    with torch.device("meta"):
        model = Transformer(args)
    mesh = ParallelDims(1, 1, 1).build_meshes("cpu")
    wrap(model, mesh, param_dtype)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with stored_parameters():
        model.init_weights(sharded_init_normal_)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    data = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, 512, (2, 33), generator=data)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        norms.append(clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _fsdp_one_rank(model, meshes, param_dtype):
    from parallel.fsdp import apply_fsdp

    apply_fsdp(model, [model.tok_embeddings, *model.layers.values(), [model.norm, model.output]], meshes.data_parallel,
               param_dtype=param_dtype, reduce_dtype=torch.float32)


def _no_wrapper(model, meshes, param_dtype):
    from parallel.data_parallel import apply_data_parallel

    apply_data_parallel(model, [], meshes, engine="fully_shard", param_dtype=param_dtype, reduce_dtype=torch.float32)
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())


def _compare(rank, world_size, results):
    for dtype in (torch.float32, torch.bfloat16):
        results[str(dtype)] = (_train(dtype, _fsdp_one_rank), _train(dtype, _no_wrapper))


def test_dp1_matches_fsdp2_on_one_rank():
    import multiprocessing

    with multiprocessing.Manager() as manager:
        results = manager.dict()
        run_distributed(_compare, 1, results)
        results = dict(results)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        (fsdp_losses, fsdp_norms), (losses, norms) = results[str(dtype)]
        for name, ref, got in (("loss", fsdp_losses, losses), ("grad norm", fsdp_norms, norms)):
            worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
            assert worst < tolerance, f"{dtype} {name}: {ref} vs {got} (rel {worst:.2e})"


def test_dp1_embedding_looks_up_fp32_rows_and_casts_them():
    """At dp = 1 the embedding table never exists in bf16, in forward or as its gradient.

    A bf16 copy of the table (and its bf16 gradient) would add two table-sized tensors, the
    second one at the end of backward next to every other gradient. Forward is the same bits
    as cast-then-look-up; the gradient is the fp32 scatter-add of the incoming bf16 gradient.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallel.data_parallel import apply_compute_dtype

    table_shape = (512, 64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(*table_shape), torch.nn.Linear(64, 8))
    apply_compute_dtype(model, torch.bfloat16)
    weight = model[0].weight
    tokens = torch.randint(0, 512, (4, 100))  # 400 lookups of 512 rows: many rows repeat

    class TableCopies(TorchDispatchMode):
        bf16_tables = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and tuple(t.shape) == table_shape:
                    TableCopies.bf16_tables += 1
            return out

    with TableCopies():
        rows = model[0](tokens)
        rows.retain_grad()
        model[1](rows).float().square().sum().backward()
    assert TableCopies.bf16_tables == 0
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, torch.nn.functional.embedding(tokens, weight.detach().bfloat16()))
    expected = torch.zeros(table_shape).index_add_(0, tokens.flatten(), rows.grad.flatten(0, 1).float())
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, expected, rtol=1e-6, atol=0)


PLACEMENTS_SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # test-only fake backend
from models import get_model_spec
from parallel.data_parallel import apply_data_parallel
from parallel.mesh import ParallelDims
from parallel.tensor_parallel import apply_tensor_parallel
world, tp, rank = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
dims = ParallelDims.resolve(world, 1, -1, tp)
meshes = dims.build_meshes("cpu")
spec = get_model_spec("llama3")
args = spec.build_args("8B", vocab_size=128256, max_seq_len=8192)
layouts = {}
for engine in ("fully_shard", "graph"):
    with torch.device("meta"):
        model = spec.model_cls(args)
    apply_tensor_parallel(model, meshes.tp, spec.root_tp_plan(True, True))
    for block in spec.blocks(model).values():
        apply_tensor_parallel(block, meshes.tp, spec.block_tp_plan(True))
    apply_data_parallel(model, spec.fsdp_units(model), meshes, engine=engine,
                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layouts[engine] = {n: [str(p.device_mesh.mesh_dim_names), str(p.placements), list(p.shape), list(p.to_local().shape)]
                       for n, p in model.named_parameters()}
print(json.dumps(layouts))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("world, tp, rank", [(128, 8, 3), (24, 8, 23)])  # even; dp = 3 leaves uneven shards
def test_graph_engine_lays_out_parameters_as_fully_shard(world, tp, rank):
    """Same names, meshes, placements, global and local shapes as fully_shard (8B, fake process
    group), so optimizer state and DCP checkpoints are interchangeable between the engines."""
    proc = subprocess.run([sys.executable, "-c", PLACEMENTS_SCRIPT, str(world), str(tp), str(rank)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    layouts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert layouts["graph"] == layouts["fully_shard"]
    assert "_StridedShard" in layouts["graph"]["layers.0.attention.wq.weight"][1]
