"""The TP plan and FSDP on meshes far larger than this machine, via PyTorch's fake process group.

One rank of a 128-rank (8B, dp 16 x tp 8) and a 512-rank (405B, dp 64 x tp 8) job builds the
model on the meta device, applies TP + FSDP, and checks every parameter's local shard: the
global shape is the published one, TP splits heads/hidden/vocab as the plan says, and local
shards times the mesh add back up to the parameter count.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import ROOT

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # test-only fake backend
from models import get_model_spec
from parallel.mesh import ParallelDims
from parallel.tensor_parallel import apply_tensor_parallel
from parallel.fsdp import apply_fsdp
flavor, world, tp, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
dims = ParallelDims.resolve(world, 1, -1, tp)
meshes = dims.build_meshes("cpu")
spec = get_model_spec("llama3")
args = spec.build_args(flavor, vocab_size=128256, max_seq_len=8192)
dims.check_divisible(spec.tp_divisible_sizes(args))
with torch.device("meta"):
    model = spec.model_cls(args)
apply_tensor_parallel(model, meshes.tp, spec.root_tp_plan(True, True))
for block in spec.blocks(model).values():
    apply_tensor_parallel(block, meshes.tp, spec.block_tp_plan(True))
apply_fsdp(model, spec.fsdp_units(model), meshes.data_parallel, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
params = {n: {"global": list(p.shape), "local": list(p.to_local().shape), "placements": [type(x).__name__ for x in p.placements]}
          for n, p in model.named_parameters()}
print(json.dumps({"params": params, "num_params": model.num_params(), "dp": dims.dp}))
dist.destroy_process_group()
"""


def plan(flavor, world, tp, rank=3):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, flavor, str(world), str(tp), str(rank)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flavor, world, tp, published", [("8B", 128, 8, 8.03e9), ("405B", 512, 8, 405.9e9)])
def test_plan_shards_every_parameter(flavor, world, tp, published):
    result = plan(flavor, world, tp)
    dp = result["dp"]
    params = result["params"]
    assert abs(result["num_params"] - published) / published < 0.01
    wq = params["layers.0.attention.wq.weight"]
    assert wq["local"] == [wq["global"][0] // tp // dp, wq["global"][1]]  # heads over tp, then rows over dp
    wo = params["layers.0.attention.wo.weight"]
    assert wo["local"] == [wo["global"][0] // dp, wo["global"][1] // tp]
    emb = params["tok_embeddings.weight"]
    assert emb["local"][0] * tp * dp >= emb["global"][0] > (emb["local"][0] - 1) * tp * dp  # vocab over tp, then dp
    norm = params["layers.0.attention_norm.weight"]
    assert "Replicate" in norm["placements"] and norm["local"] == [norm["global"][0] // dp]
    total_local = sum(_numel(p["local"]) * (dp if "Replicate" in p["placements"] else dp * tp) for p in params.values())
    assert abs(total_local - result["num_params"]) / result["num_params"] < 1e-3  # FSDP pads uneven dims


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n
