"""The exported model loads in Hugging Face `LlamaForCausalLM` and gives our logits.

Runs only where `transformers` is installed (the GPU machine has it; CI does not).
"""

import dataclasses

import pytest
import torch

from models.llama3.args import flavor_args
from models.llama3.model import Transformer
from trainer.export import write_hf_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("scaled_rope", [False, True])
def test_llama_for_causal_lm_matches(tmp_path, scaled_rope):
    args = dataclasses.replace(flavor_args("tinymodel", vocab_size=512, max_seq_len=64),
                               use_scaled_rope=scaled_rope, rope_original_max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    write_hf_checkpoint(model.state_dict(), args, str(tmp_path))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    tokens = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
