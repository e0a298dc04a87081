"""Llama 3's parallel plan: which module gets which placement. The mechanics live in parallel/.

| module                         | sequence parallel on                 | off              |
|--------------------------------|--------------------------------------|------------------|
| tok_embeddings                 | vocab rows sharded, out Shard(1)     | out Replicate    |
| attention_norm / ffn_norm/norm | SequenceParallel (Shard(1))          | replicated       |
| attention / feed_forward input | all-gather seq: Shard(1)->Replicate  | -                |
| wq, wk, wv, w1, w3             | ColwiseParallel (heads / hidden)     | same             |
| wo, w2                         | RowwiseParallel, out Shard(1)        | out Replicate    |
| output                         | Colwise; Shard(-1) logits if loss parallel, else Replicate |  |
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from models.llama3.args import ModelArgs
from models.llama3.model import Transformer
from parallel.tensor_parallel import TPPlan, VocabParallel


def root_tp_plan(sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
    """Plan for the modules outside the transformer blocks."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: TPPlan = {
        "tok_embeddings": VocabParallel(output_layout=residual),
        "output": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def block_tp_plan(sequence_parallel: bool) -> TPPlan:
    """Plan applied to every transformer block."""
    plan: TPPlan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sequence_parallel:
        plan.update({
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    else:
        plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
    return plan


def tp_divisible_sizes(args: ModelArgs) -> dict[str, int]:
    """Sizes the tensor-parallel degree must divide, named for the error message."""
    return {
        "model n_heads": args.n_heads,
        "model n_kv_heads": args.kv_heads,
        "model FFN hidden size": args.ffn_hidden_dim,
        "model vocab size": args.vocab_size,
    }


def blocks(model: Transformer) -> nn.ModuleDict:
    return model.layers


def head(model: Transformer) -> nn.Linear:
    return model.output


def fsdp_units(model: Transformer) -> list:
    """Embedding, each block, then norm + head together (they run back to back)."""
    return [model.tok_embeddings, *model.layers.values(), [model.norm, model.output]]
