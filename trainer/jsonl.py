"""JSON-lines record files that a resumed run continues without repeating steps."""

from __future__ import annotations

import json
import os
from typing import Any


def truncate_after(path: str, last_step: int) -> list[dict[str, Any]]:
    """Keep (atomically) the records of steps <= last_step and return them.

    A run resumed from the checkpoint of step S writes steps S+1.. again, so what an earlier
    process wrote past S goes; a fresh run (last_step 0) starts an empty file. A torn last
    line from a killed process is dropped too.
    """
    if not os.path.exists(path):
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
                if record["step"] <= last_step:
                    kept.append(record)
            except (ValueError, KeyError, TypeError):
                continue
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)
    return kept


class JsonlWriter:
    """Appends one JSON object per line, flushed at once so that a crash loses nothing written."""

    def __init__(self, path: str, start_step: int) -> None:
        self.previous = truncate_after(path, start_step)
        self.file = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
