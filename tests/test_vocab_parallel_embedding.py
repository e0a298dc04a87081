"""The vocab-parallel embedding equals nn.Embedding in output and weight gradient."""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from parallel.tensor_parallel import VocabParallel
from tests.dist_utils import run_distributed

VOCAB, DIM = 48, 8


def _check(mesh, layout: str) -> None:
    rank, world_size = mesh.get_local_rank(), mesh.size()
    torch.manual_seed(0)
    reference = nn.Embedding(VOCAB, DIM)
    tokens = torch.randint(0, VOCAB, (2, 8))
    tokens[0, :4] = torch.tensor([0, VOCAB - 1, VOCAB // world_size, VOCAB // world_size - 1])  # slice edges
    placement = Shard(1) if layout == "shard" else Replicate()
    sharded = VocabParallel(output_layout=placement, use_local_output=False).build(
        nn.Embedding.from_pretrained(reference.weight.detach().clone(), freeze=False), mesh)

    expected = reference(tokens)
    out = sharded(tokens)
    torch.testing.assert_close(out.full_tensor(), expected, rtol=0, atol=0)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    out.backward(torch.distributed.tensor.distribute_tensor(grad_out, mesh, [placement]))
    grad = sharded.weight.grad
    torch.testing.assert_close(grad.full_tensor(), reference.weight.grad, rtol=1e-6, atol=1e-6)
    # each rank's local gradient is non-zero only on the rows it owns
    local = grad.to_local()
    assert local.shape[0] == VOCAB // world_size
    own = reference.weight.grad[rank * local.shape[0]:(rank + 1) * local.shape[0]]
    torch.testing.assert_close(local, own, rtol=1e-6, atol=1e-6)
    # the sharded weight is the unsharded [vocab, dim] tensor for checkpoints
    assert sharded.weight.shape == (VOCAB, DIM)
    torch.testing.assert_close(sharded.weight.full_tensor(), reference.weight)


def _all_cases(rank: int, world_size: int) -> None:
    tp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    tp2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    for mesh in (tp4, tp2):
        for layout in ("shard", "replicate"):
            _check(mesh, layout)


def test_matches_nn_embedding_tp2_and_tp4():
    """One 4-process group covers tp=4 and tp=2 (inside a 2x2 mesh), sequence-sharded and replicated output."""
    run_distributed(_all_cases, 4)
