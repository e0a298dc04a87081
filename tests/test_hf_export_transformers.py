"""The exported model loads in Hugging Face `LlamaForCausalLM` and gives our logits, and what
`save_pretrained` writes (its own shards, index and config.json keys) loads back into ours.

One file without, and several shards with Llama 3.1 RoPE scaling (read through the index).

Runs only where `transformers` is installed (the GPU machine has it; CI does not).
"""

import dataclasses

import pytest
import torch

from models.llama3.args import flavor_args
from models.llama3.hf import hf_adapter
from models.llama3.model import Transformer
from trainer.export import export_hf
from trainer.initial_load import load_hf_weights

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("scaled_rope, max_shard_bytes", [(False, 5 * 10**9), (True, 100_000)])
def test_llama_for_causal_lm_matches(tmp_path, scaled_rope, max_shard_bytes):
    args = dataclasses.replace(flavor_args("tinymodel", vocab_size=512, max_seq_len=64),
                               use_scaled_rope=scaled_rope, rope_original_max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    export_hf(model.state_dict(), hf_adapter(args), str(tmp_path / "hf"), max_shard_bytes=max_shard_bytes)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    tokens = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

    hf.save_pretrained(str(tmp_path / "saved"), max_shard_size=max_shard_bytes)
    torch.manual_seed(1)
    fresh = Transformer(args)
    fresh.init_weights()
    load_hf_weights(fresh, hf_adapter(args), str(tmp_path / "saved"), vocab_size=512)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), ours, rtol=1e-6, atol=1e-6)
