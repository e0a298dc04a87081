"""Finding input files and reading their documents, with one-line errors that name the file.

A source string (`training.dataset_path`, an item of `training.dataset_mixture`, ...) is a
file, a folder (searched recursively) or a glob. It resolves to sorted files of one kind:
text documents (`.txt`, `.jsonl`, `.json`, `.parquet`) or tokens already written by some
tool (`.bin` with its `.bin.json` sidecar, `.npy`; see `store.py`). "stdlib" is the
embedded default corpus.

Text files are read here rather than through `datasets`' builders so that a bad document is
reported with its file and line (non-UTF-8 bytes, broken JSON, a `text` that is not a
string), and so that one reader serves both the token-store build (in worker processes) and
streaming. Large files are cut into `Piece`s (byte ranges of a `.jsonl`, row groups of a
`.parquet`) so that one big file still tokenizes in parallel.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

from trainer.config import ConfigError

TEXT_FORMATS = (".txt", ".jsonl", ".json", ".parquet")
TOKEN_FORMATS = (".bin", ".npy")
SIDECAR_SUFFIX = ".json"  # `tokens.bin` is described by `tokens.bin.json`
STDLIB = "stdlib"
PIECE_BYTES_MIN = 1 << 20  # pieces are at least 1 MiB of input...
PIECE_BYTES_MAX = 256 << 20  # ...at most 256 MiB, and about 1/64 of the corpus in between


@dataclass(frozen=True)
class Piece:
    """A part of one input file: bytes [start, stop) of a .jsonl, row groups [start, stop) of a
    .parquet, or the whole file (start = 0, stop = -1). `lenient` reads text with replacement
    characters instead of failing on bad UTF-8 (the stdlib corpus has a few such files)."""

    path: str
    start: int = 0
    stop: int = -1
    lenient: bool = False

    @property
    def kind(self) -> str:
        return os.path.splitext(self.path)[1].lower()


def stdlib_files(max_files: int | None = None) -> list[str]:
    """The embedded default corpus: the Python standard library's own .py sources.

    All `.py` files under `sysconfig.get_paths()['stdlib']` (site-/dist-packages excluded),
    sorted by path: ~30 MB / ~7.7M cl100k tokens on CPython 3.11, present everywhere, no
    download. It differs between Python versions, which is why the cache key includes every
    file's size and mtime. `max_files` keeps the first N (tests).
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    files.sort()
    return files[:max_files]


def _is_sidecar(path: str) -> bool:
    return path.lower().endswith(".bin" + SIDECAR_SUFFIX)


def resolve_files(source: str, key: str) -> list[str]:
    """A file, a folder (searched recursively) or a glob -> sorted files of one supported kind."""
    if source == STDLIB:
        return stdlib_files()
    source = os.path.expanduser(source)
    if os.path.isdir(source):
        found = glob.glob(os.path.join(glob.escape(source), "**", "*"), recursive=True)
    else:
        found = glob.glob(source, recursive=True)
    supported = TEXT_FORMATS + TOKEN_FORMATS
    files = sorted(f for f in found if os.path.isfile(f) and not _is_sidecar(f)
                   and os.path.splitext(f)[1].lower() in supported)
    if not files:
        raise ConfigError(
            f"{key} '{source}' matches no {'/'.join(supported)} files. Point it at a folder or glob "
            "of such files (e.g. 'data/*.jsonl')."
        )
    kinds = {os.path.splitext(f)[1].lower() for f in files}
    if len(kinds) > 1 and not (kinds <= set(TOKEN_FORMATS)):
        raise ConfigError(
            f"{key} '{source}' mixes formats ({', '.join(sorted(kinds))}). Point it at files of one "
            "format (.bin and .npy token files may be mixed)."
        )
    return files


def is_pretokenized(files: list[str]) -> bool:
    return os.path.splitext(files[0])[1].lower() in TOKEN_FORMATS


def plan_pieces(files: list[str], *, lenient: bool = False) -> list[Piece]:
    """Cut files into pieces of about 1/64 of the corpus (clamped to [1, 256] MiB).

    The plan depends only on the files, never on the number of processes, so a build that
    was interrupted finds its finished pieces again under the same names.
    """
    sizes = [os.path.getsize(f) for f in files]
    target = min(max(sum(sizes) // 64, PIECE_BYTES_MIN), PIECE_BYTES_MAX)
    pieces: list[Piece] = []
    for path, size in zip(files, sizes):
        kind = os.path.splitext(path)[1].lower()
        if kind == ".jsonl" and size > target:
            pieces += [Piece(path, s, min(s + target, size), lenient) for s in range(0, size, target)]
        elif kind == ".parquet" and size > target:
            import pyarrow.parquet as pq

            groups = pq.ParquetFile(path).num_row_groups
            step = max(1, groups * target // size)
            pieces += [Piece(path, g, min(g + step, groups), lenient) for g in range(0, groups, step)]
        else:
            pieces.append(Piece(path, 0, -1, lenient))
    return pieces


def group_pieces(pieces: list[Piece]) -> list[list[Piece]]:
    """Consecutive pieces joined into work units of about the piece target size each."""
    total = sum(piece_bytes(p) for p in pieces)
    target = min(max(total // 64, PIECE_BYTES_MIN), PIECE_BYTES_MAX)
    units: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        current.append(piece)
        size += piece_bytes(piece)
        if size >= target:
            units.append(current)
            current, size = [], 0
    if current:
        units.append(current)
    return units


def piece_bytes(piece: Piece) -> int:
    """Input bytes of a piece (row groups of a Parquet file are counted as an even share)."""
    if piece.kind == ".jsonl" and piece.stop >= 0:
        return piece.stop - piece.start
    size = os.path.getsize(piece.path)
    if piece.kind == ".parquet" and piece.stop >= 0:
        import pyarrow.parquet as pq

        return size * (piece.stop - piece.start) // max(pq.ParquetFile(piece.path).num_row_groups, 1)
    return size


def _bad(path: str, where: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"data file '{path}'{where}: {problem}. {fix}")


def _text_of(record: object, path: str, where: str) -> str | None:
    if not isinstance(record, dict) or "text" not in record:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise _bad(path, where, f"record has no 'text' field (found {found})",
                   "Store each document in a 'text' field.")
    text = record["text"]
    if text is not None and not isinstance(text, str):
        raise _bad(path, where, f"'text' holds {type(text).__name__} {str(text)[:40]!r}, not a string",
                   "Store each document's text as a JSON string.")
    return text


def _read_txt(piece: Piece) -> Iterator[str | None]:
    try:
        with open(piece.path, encoding="utf-8", errors="replace" if piece.lenient else "strict") as f:
            yield f.read()
    except UnicodeDecodeError as e:
        raise _bad(piece.path, f" (byte {e.start})", "is not UTF-8 text", "Re-encode the file as UTF-8.") from None


def _read_jsonl(piece: Piece) -> Iterator[str | None]:
    """Lines that *start* in [start, stop) belong to this piece."""
    stop = piece.stop if piece.stop >= 0 else os.path.getsize(piece.path)
    with open(piece.path, "rb") as f:
        pos = piece.start
        if pos > 0:
            f.seek(pos - 1)
            pos += len(f.readline()) - 1  # finish the line that started in the previous piece
        line_no = 0
        while pos < stop:
            raw = f.readline()
            if not raw:
                break
            line_no += 1
            where = f", line {line_no}" if piece.start == 0 else f", the line at byte {pos}"
            pos += len(raw)
            if raw.strip():
                yield _jsonl_text(raw, piece, where)


def _jsonl_text(raw: bytes, piece: Piece, where: str) -> str | None:
    try:
        line = raw.decode("utf-8", errors="replace" if piece.lenient else "strict")
    except UnicodeDecodeError as e:
        raise _bad(piece.path, where, f"is not UTF-8 (byte {raw[e.start]:#04x} at column {e.start})",
                   "Re-encode the file as UTF-8.") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise _bad(piece.path, where, f"is not valid JSON ({e.msg})", "Fix or remove that line.") from None
    return _text_of(record, piece.path, where)


def _read_json(piece: Piece) -> Iterator[str | None]:
    try:
        with open(piece.path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError as e:
        raise _bad(piece.path, f" (byte {e.start})", "is not UTF-8", "Re-encode the file as UTF-8.") from None
    except json.JSONDecodeError as e:
        raise _bad(piece.path, f", line {e.lineno}", f"is not valid JSON ({e.msg})", "Fix the file.") from None
    if not isinstance(data, list):
        raise _bad(piece.path, "", f"holds a JSON {type(data).__name__}, not an array of records",
                   "Store a JSON array of {\"text\": ...} records, or use JSON Lines (.jsonl).")
    for i, record in enumerate(data):
        yield _text_of(record, piece.path, f", record {i}")


def _read_parquet(piece: Piece) -> Iterator[str | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(piece.path)
    except (OSError, pa.ArrowException) as e:
        raise _bad(piece.path, "", f"is not a readable Parquet file ({e})", "Fix or remove it.") from None
    field = pf.schema_arrow.field("text") if "text" in pf.schema_arrow.names else None
    if field is None:
        raise _bad(piece.path, "", f"has no 'text' column (found {pf.schema_arrow.names})",
                   "Store each document in a 'text' column.")
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise _bad(piece.path, "", f"'text' column has type {field.type}, not string",
                   "Store each document's text as a string.")
    groups = range(piece.start, piece.stop) if piece.stop >= 0 else range(pf.num_row_groups)
    for batch in pf.iter_batches(columns=["text"], row_groups=list(groups)):
        yield from batch.column(0).to_pylist()


_READERS = {".txt": _read_txt, ".py": _read_txt, ".jsonl": _read_jsonl, ".json": _read_json,
            ".parquet": _read_parquet}


def read_documents(piece: Piece) -> Iterator[str]:
    """The non-empty documents of one piece, in file order."""
    for text in _READERS[piece.kind](piece):
        if text:
            yield text


def generate_documents(pieces: list[Piece]) -> Iterator[dict[str, str]]:
    """`{"text": ...}` records of `pieces`: the generator behind a streamed local source
    (`datasets.IterableDataset.from_generator` shards it by pieces)."""
    for piece in pieces:
        for text in read_documents(piece):
            yield {"text": text}
