"""Tensor parallelism: apply a model's TP plan, with a compile-safe vocab-parallel embedding.

Why our own embedding: PyTorch's `RowwiseParallel` on `nn.Embedding` returns a `_MaskPartial`
DTensor whose mask buffer breaks whole-model `torch.compile` under FSDP2 + TP (torch 2.11 and
2.13; pytorch#159843, pytorch#160697, torchtitan#534, ../shared/repro). Here each tp rank owns
a contiguous slice of the vocab rows, masks ids outside it on its local tensor, looks them up,
and combines the partial sums with a plain `Partial` -> Shard(1)/Replicate redistribute: a
reduce-scatter (sequence parallel) or all-reduce that Dynamo traces as a functional collective.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` whose rows are sharded over a tp mesh; keeps the `weight` name and the
    global [vocab, dim] DTensor layout, so checkpoints load and save the unsharded tensor."""

    def __init__(self, embedding: nn.Embedding, tp_mesh: DeviceMesh, output_layout: Placement, use_local_output: bool):
        super().__init__()
        vocab = embedding.num_embeddings
        tp = tp_mesh.size()
        if vocab % tp:
            raise ValueError(f"vocab size {vocab} is not divisible by the tensor-parallel degree {tp}")
        self.num_embeddings = vocab
        self.rows_per_rank = vocab // tp
        self.vocab_start = tp_mesh.get_local_rank() * self.rows_per_rank
        self.output_layout = output_layout
        self.use_local_output = use_local_output
        self.weight = nn.Parameter(
            distribute_tensor(embedding.weight.detach(), tp_mesh, [Shard(0)], src_data_rank=None),
            requires_grad=embedding.weight.requires_grad,
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        local_weight = weight.to_local()
        local_ids = tokens - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.rows_per_rank)
        # Out-of-slice ids look up row 0 and are zeroed, so their gradient to row 0 is zero too.
        partial = F.embedding(local_ids.masked_fill(outside, 0), local_weight)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        out = DTensor.from_local(partial, weight.device_mesh, [Partial()], run_check=False)
        out = out.redistribute(weight.device_mesh, [self.output_layout])
        return out.to_local() if self.use_local_output else out


class VocabParallel:
    """Plan entry that swaps an `nn.Embedding` for `VocabParallelEmbedding`."""

    def __init__(self, *, output_layout: Placement = Replicate(), use_local_output: bool = True):
        self.output_layout = output_layout
        self.use_local_output = use_local_output

    def build(self, module: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallel applies to nn.Embedding, got {type(module).__name__}")
        return VocabParallelEmbedding(module, tp_mesh, self.output_layout, self.use_local_output)


TPPlan = dict[str, Union[ParallelStyle, VocabParallel]]


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> None:
    """Apply `plan` (submodule path -> style) to `module` in place.

    torch's `ParallelStyle`s go through `parallelize_module`; `VocabParallel` entries replace
    their submodule, which `parallelize_module` cannot do.
    """
    for path, style in plan.items():
        if isinstance(style, VocabParallel):
            module.set_submodule(path, style.build(module.get_submodule(path), tp_mesh))
        else:
            parallelize_module(module, tp_mesh, {path: style})
