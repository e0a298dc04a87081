"""Cross-entropy over padded vocabularies, for replicated or vocab-sharded (loss-parallel) logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mean token cross-entropy in fp32; logit columns >= `num_classes` (vocab padding rows)
    get -inf, so they never take probability mass and never receive gradient.

    With loss parallel the logits are a DTensor sharded on the vocab dim and this must run
    under `torch.distributed.tensor.parallel.loss_parallel()`, which computes the softmax with
    collectives instead of gathering the full logits.
    """
    vocab = logits.shape[-1]
    if isinstance(logits, DTensor):
        if logits.placements != (Shard(logits.ndim - 1),) and logits.placements != (Shard(-1),):
            raise ValueError(f"loss parallel expects logits sharded on the vocab dim, got {logits.placements}")
        if num_classes < vocab:
            local = logits.to_local()
            mesh = logits.device_mesh
            start = mesh.get_local_rank() * local.shape[-1]
            column = torch.arange(start, start + local.shape[-1], device=local.device)
            local = local.masked_fill(column >= num_classes, float("-inf"))
            logits = DTensor.from_local(local, mesh, logits.placements, run_check=False)
    elif num_classes < vocab:
        logits = logits[..., :num_classes]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
