"""Token data for training: a memory-mapped token store (or a stream) read in a seeded,
mesh-independent order and cut into micro-batches. See docs/data.md.

- documents.py: input files and their documents; ingest.py + lock.py: text -> token store,
  once per filesystem; store.py: the token file format, memory-mapped.
- order.py: seeded window order and mixture schedule, computed per index.
- sources.py: one class per source kind (stored, streamed) behind one interface.
- loader.py: steps -> micro-batches, token shares, resume state; build.py: config -> loader.

What the trainer uses: `build_dataloader`, then `next_step()`, `shares()`, `reset()` and
`state_dict()` / `load_state_dict()` on the loader.
"""

from trainer.data.build import build_dataloader, validation_windows
from trainer.data.loader import TokenDataLoader

__all__ = ["TokenDataLoader", "build_dataloader", "validation_windows"]
