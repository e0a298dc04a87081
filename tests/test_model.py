"""Llama 3 shapes, parameter counts, FLOPs and the forward pass."""

import pytest
import torch

from models.llama3.args import flavor_args, padded_vocab_size
from models.llama3.model import Transformer, apply_rope, rope_table

LLAMA3_VOCAB = 128256


@pytest.mark.parametrize("flavor, published", [
    ("1B", 1.50e9), ("3B", 3.61e9), ("8B", 8.03e9), ("70B", 70.6e9), ("405B", 405.9e9),
])
def test_param_counts_on_meta(flavor, published):
    with torch.device("meta"):
        model = Transformer(flavor_args(flavor, vocab_size=LLAMA3_VOCAB, max_seq_len=128))
    assert abs(model.num_params() - published) / published < 0.01


def test_published_hidden_sizes():
    sizes = {f: flavor_args(f, vocab_size=1, max_seq_len=1).ffn_hidden_dim for f in ("1B", "3B", "8B", "70B", "405B")}
    assert sizes == {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}


def test_vocab_padding():
    assert padded_vocab_size(100277) == 100352
    assert padded_vocab_size(100277, 128256) == 128256
    with pytest.raises(ValueError):
        padded_vocab_size(100277, 50000)


def test_flops_per_token_formula():
    args = flavor_args("8B", vocab_size=LLAMA3_VOCAB, max_seq_len=8192)
    with torch.device("meta"):
        model = Transformer(args)
    non_embedding = model.num_params() - LLAMA3_VOCAB * args.dim
    assert model.flops_per_token(8192) == 6 * non_embedding + 12 * 32 * 4096 * 8192


def test_forward_shape_and_causality():
    torch.manual_seed(0)
    model = Transformer(flavor_args("tinymodel", vocab_size=512, max_seq_len=16))
    model.init_weights()
    tokens = torch.randint(0, 512, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 512)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 512
    # positions before the change must not see it
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_meta_init_matches_eager_init():
    args = flavor_args("tinymodel", vocab_size=512, max_seq_len=16)
    eager = Transformer(args)
    torch.manual_seed(3)
    eager.init_weights()
    with torch.device("meta"):
        meta = Transformer(args)
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights(buffer_device=torch.device("cpu"))
    for (name, a), b in zip(eager.state_dict().items(), meta.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    torch.testing.assert_close(eager.rope, meta.rope)


def test_depth_scaled_init():
    torch.manual_seed(0)
    model = Transformer(flavor_args("debugmodel", vocab_size=512, max_seq_len=16))
    model.init_weights()
    first = model.layers["0"].attention.wo.weight.std().item()
    n = model.args.n_layers
    last = model.layers[str(n - 1)].attention.wo.weight.std().item()
    assert first == pytest.approx(0.02 / 2 ** 0.5, rel=0.1)
    assert last == pytest.approx(0.02 / (2 * n) ** 0.5, rel=0.1)


def _rope_angles(table: torch.Tensor) -> torch.Tensor:
    """[positions, head_dim // 2] angles of rope_table's (cos, signed sin) layout."""
    return torch.atan2(table[:, 1, 1::2], table[:, 0, ::2])


def test_rope_table_layout():
    table = rope_table(flavor_args("tinymodel", vocab_size=8, max_seq_len=16))
    torch.testing.assert_close(table[:, 0, ::2], table[:, 0, 1::2])  # cos repeated per pair
    torch.testing.assert_close(table[:, 1, ::2], -table[:, 1, 1::2])  # sin signed (-, +)


def test_rope_matches_complex_reference():
    args = flavor_args("tinymodel", vocab_size=8, max_seq_len=16)
    table = rope_table(args)
    x = torch.randn(2, 16, 4, args.head_dim)
    freqs = torch.polar(torch.ones(16, args.head_dim // 2), _rope_angles(table))
    ref = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs[None, :, None]).flatten(-2)
    torch.testing.assert_close(apply_rope(x, table), ref)


def test_scaled_rope_stretches_only_low_frequencies():
    import dataclasses

    scaled_args = flavor_args("8B", vocab_size=8, max_seq_len=2)
    plain_args = dataclasses.replace(scaled_args, use_scaled_rope=False)
    # angle at position 1 is the frequency itself
    scaled = _rope_angles(rope_table(scaled_args))[1]
    plain = _rope_angles(rope_table(plain_args))[1]
    torch.testing.assert_close(scaled[0], plain[0])  # highest frequency untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / scaled_args.rope_scale_factor)  # lowest divided
