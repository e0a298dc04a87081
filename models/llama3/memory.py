"""What a Llama 3 block saves for backward, per activation-checkpointing kind, eager and compiled.

Counted tensor by tensor from models/llama3/model.py and the parallel plan, in bytes per token
of one rank's micro-batch (every tp rank sees all tokens; sequence parallel divides the
residual stream and the norms by tp), then checked against the tensors a real block keeps
alive on CPU (tests/test_memory_estimate.py, scripts/measure_activations.py; the numbers are
in docs/planning.md). a = bytes of the compute dtype; d = dim; kv = kv heads x head dim;
f = FFN hidden size; h = heads.

Eager, no checkpointing, per block:
  2 norms      each saves its input (a*d; the fused CUDA kernel) and rstd (4); CPU's composite
               rms_norm instead keeps the fp32 input and the fp32 normalized input (8d)
  2 x a*d      the projections' input (under sequence parallel: the all-gather's output)
  a*d/tp + 2 x a*kv/tp  SDPA's inputs: rotated q, and k and v with their grouped heads (SDPA
               takes grouped KV heads itself, models/kernels.py)
  2 x 2a*hd    RoPE's cos/sin table cast to the compute dtype, once for q and once for k
  a*d/tp + 4h/tp  SDPA's output (also wo's input) and its log-sum-exp
  4 x a*f/tp   w1 and w3 outputs, silu's output, their product (w2's input)
Compiled (inductor's partitioner, measured with torch 2.13): the norms keep one residual
  tensor (a*d/sp) and their rstd instead of fp32 copies, and only 3 of the 4 FFN tensors.
"full" (recompute all but attention and collectives): the block input (a*d/sp), SDPA's output
  and log-sum-exp, and every collective output: under sequence parallel 2 all-gathers (a*d)
  and 2 reduce-scatters (a*d/tp), else with tp > 1 2 all-reduces (a*d). Compiled keeps only
  the collective outputs backward needs: both all-gathers and the first reduce-scatter (the
  residual), or the first all-reduce.
"op" (parallel/activation_checkpoint.py saves the 1st, 3rd, 5th and 7th matmul: wq, wv, w1,
  w2): "full" plus q (a*d/tp), v (a*kv/tp), w1's output (a*f/tp), and w2's local output before
  its tp reduction (a*d). Compiled drops w2's output (backward never reads it).
"op_all" (op SAC saving every matmul): "op" plus k (a*kv/tp), wo's local output (a*d) and
  w3's output (a*f/tp).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.llama3.args import ModelArgs
from models.llama3.model import TransformerBlock, rope_table
from models.llama3.parallelize import block_tp_plan
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.data_parallel import apply_compute_dtype
from parallel.memory import ActivationBytes, ActivationInputs, retained_bytes, saved_tensor_bytes, unit_bytes
from parallel.tensor_parallel import apply_tensor_parallel


def _norm_bytes(args: ModelArgs, s: ActivationInputs, tokens: int) -> int:
    """An eager RMSNorm over `tokens` rows: its input (CPU composite: the fp32 input and the fp32
    normalized input) and rstd."""
    return (s.compute_bytes if s.fused_norm else 8) * args.dim * tokens + 4 * tokens


def _block_bytes(args: ModelArgs, s: ActivationInputs) -> dict[str, int]:
    """Bytes one block keeps for backward, for each checkpointing kind."""
    a, tp, t = s.compute_bytes, s.tp, s.tokens
    t_sp = t // tp if s.sequence_parallel else t  # rows of the residual stream on this rank
    d, kv, f, h = args.dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim, args.n_heads
    residual = a * d * t_sp
    rstd = 4 * t_sp
    projection_input = a * d * t
    q = attention_out = a * d // tp * t
    attention = attention_out + 4 * h // tp * t  # SDPA's output and log-sum-exp
    v = a * kv // tp * t
    rope = 2 * 2 * a * args.head_dim * t  # the cos/sin table cast to the compute dtype, for q and for k
    ffn = a * f // tp * t
    if tp == 1:
        collectives = needed_collectives = 0
    elif s.sequence_parallel:
        collectives = 2 * a * d * t + 2 * residual  # 2 all-gathers, 2 reduce-scatters
        needed_collectives = 2 * a * d * t + residual
    else:
        collectives, needed_collectives = 2 * a * d * t, a * d * t  # 2 all-reduces; backward needs the first
    if s.compiled:
        return {
            "none": residual + 2 * rstd + 2 * projection_input + 3 * q + attention + 3 * ffn,
            "full": residual + attention + needed_collectives,
            "op": residual + attention + needed_collectives + q + v + ffn,
            "op_all": residual + attention + needed_collectives + q + 2 * v + 2 * ffn + a * d * t,
        }
    return {
        "none": 2 * _norm_bytes(args, s, t_sp) + 2 * projection_input + q + 2 * v + rope + attention + 4 * ffn,
        "full": residual + attention + collectives,
        "op": residual + attention + collectives + q + v + ffn + a * d * t,
        "op_all": residual + attention + collectives + q + 2 * v + 2 * ffn + 2 * a * d * t,
    }


def activation_bytes(args: ModelArgs, s: ActivationInputs, block_kinds: Sequence[str]) -> ActivationBytes:
    """Activations of one micro-batch on one rank; `block_kinds[i]` is block i's checkpointing
    ("none", "full", "op" or "op_all"), as read off the built model."""
    per_block = _block_bytes(args, s)
    a, tp, t = s.compute_bytes, s.tp, s.tokens
    t_sp = t // tp if s.sequence_parallel else t
    # Outside the blocks (never compiled with them): the final norm, the head's input (under
    # sequence parallel the all-gather's output), and the embedding's int64 token ids and mask.
    outside = _norm_bytes(args, s, t_sp) + a * args.dim * t + 9 * t
    # Backward of one block: what checkpointing recomputes, plus the gradients alive at once
    # at the FFN (two hidden-size gradients and the product's) and the block input's.
    gradients = 3 * a * args.ffn_hidden_dim // tp * t + a * args.dim * t
    recompute = max(per_block["none"] - per_block[kind] for kind in block_kinds)
    return ActivationBytes(
        blocks=sum(per_block[kind] for kind in block_kinds),
        outside_blocks=outside,
        block_backward=recompute + gradients,
        logits_columns=args.vocab_size // tp if s.loss_parallel else args.vocab_size,
        head_in_features=args.dim,
    )


def check_block(args: ModelArgs, kind: str, tokens: int, *, compiled: bool = False, tp_mesh: DeviceMesh | None = None,
                sequence_parallel: bool = False, cast_at_use: bool = False) -> tuple[int, int]:
    """(measured, counted) bytes one real bfloat16 block of checkpointing `kind` keeps for
    backward on this rank, the block input (the caller's) left out of both: the check of the
    count above. Eager counts every storage the forward leaves alive, compiled what AOTAutograd
    saves. Runs where it is called (CPU: composite rms_norm, so the count takes fused_norm=False).
    `cast_at_use`: fp32 parameters read as bf16 casts (the dp = 1 path), so the count adds the
    cast copies parallel/memory.py says autograd keeps."""
    torch.manual_seed(0)
    block = TransformerBlock(0, args)
    blocks = nn.ModuleDict({"0": block if cast_at_use else block.to(torch.bfloat16)})
    tp = tp_mesh.size() if tp_mesh is not None else 1
    if tp_mesh is not None:
        apply_tensor_parallel(blocks["0"], tp_mesh, block_tp_plan(sequence_parallel))
    apply_activation_checkpointing(blocks, "per_block", "op", per_block=f"{kind}:1")
    if cast_at_use:
        apply_compute_dtype(blocks, torch.bfloat16)
    block, rope = blocks["0"], rope_table(args)
    x = torch.randn(1, tokens, args.dim, dtype=torch.bfloat16)
    if sequence_parallel:  # the residual stream enters as this rank's sequence shard
        x = x.chunk(tp, dim=1)[tp_mesh.get_local_rank()].contiguous()
    x.requires_grad_()
    exclude = [x, rope, *block.parameters()]
    if compiled:
        block.compile(backend="inductor", fullgraph=True, dynamic=False)
        block(x, rope).sum().backward()  # compile outside the measurement
        measured = saved_tensor_bytes(lambda: block(x, rope), exclude)
    else:
        measured = retained_bytes(lambda: block(x, rope), exclude)
    inputs = ActivationInputs(tokens=tokens, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=False,
                              compute_bytes=2, compiled=compiled, fused_norm=False)
    counted = activation_bytes(args, inputs, [kind]).blocks
    if kind != "none":  # checkpointing keeps the block input: one residual-stream tensor
        counted -= 2 * args.dim * (tokens // tp if sequence_parallel else tokens)
    if cast_at_use:
        counted += unit_bytes([block], blocks, torch.bfloat16, torch.bfloat16)[0].compute_copies
    return measured, counted
