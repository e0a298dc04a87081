"""A record of each checkpoint file's size and crc32, written at save and checked on resume.

It catches accidental damage: a bit flip on disk, a truncated copy, a file zeroed or
overwritten by a tool. It is no defence against an attacker, who can rewrite the manifest
along with the files (what protects against running code from a checkpoint is
`checkpoint_safety`).

Cost. The crc32 is computed per 64 MiB chunk, so a single large file is split over a
thread pool (`zlib.crc32` releases the GIL on large buffers), and files are split over the
ranks so each is read once. At save time the files are still in the page cache, so this
costs CPU time, not disk reads. `scripts/time_checkpoint.py` measures it against the save.

Layout of `manifest.json`:
    {"version": 1, "algorithm": "crc32", "chunk_bytes": 67108864,
     "files": {"__0_0.distcp": {"size": 123, "crc32": [chunk crc, ...]}, ...}}
"""

from __future__ import annotations

import json
import mmap
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor

MANIFEST = "manifest.json"
CHUNK_BYTES = 64 << 20
_VERSION = 1

# Files named after the rank that wrote them: DCP's `__<rank>_<n>.distcp` (torch 2.11-2.13)
# and our `rng-rank<r>.pt`. Giving such a file to its writer reads it from that node's page
# cache; names that do not match are simply balanced over the ranks.
_WRITER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng-rank(\d+)\.pt)$")


class ManifestError(ValueError):
    """manifest.json exists but cannot be read."""


def default_threads() -> int:
    """CPU threads one rank may use: this node's cores shared by its ranks, at most 16."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(16, (os.cpu_count() or 1) // max(1, local_ranks)))


def list_files(folder: str) -> dict[str, int]:
    """Size of every regular file in `folder` except the manifest itself, by name."""
    sizes = {}
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False) and entry.name != MANIFEST:
            sizes[entry.name] = entry.stat().st_size
    return dict(sorted(sizes.items()))


def assign(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """Split the files over `world_size` ranks so that each file is read by exactly one.

    A file named after the rank that wrote it goes to that rank when it exists; the rest go,
    largest first, to the rank with the fewest bytes so far."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    rest = []
    for name, size in sizes.items():
        m = _WRITER.match(name)
        writer = int(m.group(1) or m.group(2)) if m else -1
        if 0 <= writer < world_size:
            shares[writer].append(name)
            load[writer] += size
        else:
            rest.append(name)
    for name in sorted(rest, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += sizes[name]
    return shares


def _chunk_crc(path: str, offset: int, length: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=offset) as view:
            return zlib.crc32(view)
    finally:
        os.close(fd)


def checksum(folder: str, names: list[str], threads: int | None = None) -> dict[str, dict]:
    """`{name: {"size", "crc32": [per-chunk crc]}}` for the files `names` in `folder`."""
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in names}
    tasks = [(name, off, min(CHUNK_BYTES, size - off)) for name, size in sizes.items() for off in range(0, size, CHUNK_BYTES)]
    with ThreadPoolExecutor(threads or default_threads()) as pool:
        crcs = list(pool.map(lambda t: _chunk_crc(os.path.join(folder, t[0]), t[1], t[2]), tasks))
    entries: dict[str, dict] = {name: {"size": size, "crc32": []} for name, size in sizes.items()}
    for (name, _, _), crc in zip(tasks, crcs):
        entries[name]["crc32"].append(crc)
    return entries


def write(folder: str, entries: dict[str, dict]) -> None:
    """Write manifest.json into `folder` and fsync it (the caller publishes the folder after)."""
    body = {"version": _VERSION, "algorithm": "crc32", "chunk_bytes": CHUNK_BYTES, "files": dict(sorted(entries.items()))}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(body, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


def read(folder: str) -> dict[str, dict] | None:
    """The manifest's file entries, or None when the folder has no manifest (older checkpoints)."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            body = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files, dict) or body.get("version") != _VERSION or body.get("chunk_bytes") != CHUNK_BYTES \
            or not all(_valid_entry(name, e) for name, e in files.items()):
        raise ManifestError(f"{path} is not a version-{_VERSION} weft manifest")
    return files


def _valid_entry(name: str, entry: object) -> bool:
    return (os.path.basename(name) == name and name not in ("", ".", "..") and isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("crc32"), list)
            and all(isinstance(c, int) for c in entry["crc32"]))


def compare(folder: str, entries: dict[str, dict], threads: int | None = None) -> list[str]:
    """Problems found in the files of `entries` (empty when all match), one short line each."""
    problems, present = [], []
    for name, want in entries.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
        elif os.path.getsize(path) != want["size"]:
            problems.append(f"{path} has {os.path.getsize(path)} bytes, the manifest says {want['size']}")
        else:
            present.append(name)
    for name, got in checksum(folder, present, threads).items():
        bad = [i for i, (a, b) in enumerate(zip(got["crc32"], entries[name]["crc32"])) if a != b]
        if bad or len(got["crc32"]) != len(entries[name]["crc32"]):
            where = f"bytes {bad[0] * CHUNK_BYTES}-{min((bad[0] + 1) * CHUNK_BYTES, got['size'])}" if bad else "its chunks"
            problems.append(f"{os.path.join(folder, name)}: {where} differ from the manifest (crc32)")
    return problems
