"""Cutting steps into micro-batches: which samples a step takes, and where it stands.

Step s trains on stream positions [s*G, (s+1)*G) (G = global batch); data-parallel rank r
takes [s*G + r*G/dp, s*G + (r+1)*G/dp) and splits them into micro-batches of
`local_batch_size`. A position becomes a window through the mixture schedule (which source,
which of its samples) and the source's own seeded order. So changing dp or the local batch
size changes who computes a row, never which rows a step sees, and resuming only needs the
number of samples consumed. Streamed sources are sharded per rank instead, so there each
rank counts its own positions [s*G/dp, (s+1)*G/dp) and dp must stay the same to resume.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from trainer.config import ConfigError
from trainer.data.order import MixtureSchedule
from trainer.data.sources import WindowSource

logger = logging.getLogger(__name__)

STATE_VERSION = 2  # 1 (no "version" key): the former in-memory loader's stored permutation


def check_batch_sizes(global_batch_size: int, local_batch_size: int, dp_degree: int) -> None:
    step_rows = local_batch_size * dp_degree
    if global_batch_size < 1 or global_batch_size % step_rows:
        fix = max(step_rows, global_batch_size // step_rows * step_rows)
        raise ConfigError(
            f"training.global_batch_size ({global_batch_size}) must be a positive multiple of "
            f"training.local_batch_size ({local_batch_size}) x parallelism.data_parallel_shard_degree "
            f"({dp_degree}) = {step_rows}. Set training.global_batch_size to e.g. {fix} (or -1), or "
            "change training.local_batch_size."
        )


def share_labels(names: Sequence[str]) -> list[str]:
    """Short metric labels for sources: the last path component, numbered when two collide."""
    base = [os.path.basename(n.rstrip("/")) or n for n in names]
    return [f"{b}#{i}" if base.count(b) > 1 else b for i, b in enumerate(base)]


def _describe(sources: list[dict[str, Any]]) -> str:
    parts = []
    for s in sources:
        what = "streamed" if s.get("streamed") else (
            f"{s.get('tokens')} tokens, {s.get('windows')} windows, first tokens {s.get('head')}")
        parts.append(f"{s.get('name')} ({what}, weight {s.get('weight')})")
    return " + ".join(parts)


class TokenDataLoader:
    """Stateful loader: `next_step()` returns this dp rank's micro-batches for one optimizer step."""

    def __init__(
        self,
        sources: Sequence[WindowSource],
        weights: Sequence[float] | None = None,
        *,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        device: torch.device | str = "cpu",
        allow_data_change: bool = False,
    ):
        check_batch_sizes(global_batch_size, local_batch_size, dp_degree)
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_degree})")
        if not sources or any(s.seq_len != seq_len for s in sources):
            raise ValueError(f"need sources of windows of seq_len {seq_len}")
        if len({s.rank_local for s in sources}) > 1:
            raise ValueError("a mixture is either all streamed or all stored")
        self.sources = list(sources)
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(self.sources)
        self.schedule = MixtureSchedule(self.weights)
        self.labels = share_labels([s.name for s in self.sources])
        self.rank_local = self.sources[0].rank_local
        # Stream positions per step, and where this rank's share starts: a step is G global
        # positions, rank r taking its G/dp from r*G/dp; a stream is sharded per rank already,
        # so there a step is this rank's own G/dp positions.
        per_rank = global_batch_size // dp_degree
        self._step_positions, self._rank_offset = (per_rank, 0) if self.rank_local else (
            global_batch_size, dp_rank * per_rank)
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.seed = seed
        self.device = torch.device(device)
        self.allow_data_change = allow_data_change
        self.samples_consumed = 0

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.dp_degree * self.local_batch_size)

    def _positions_before(self, samples_consumed: int) -> int:
        return samples_consumed // self.global_batch_size * self._step_positions

    def _positions(self, samples_consumed: int) -> np.ndarray:
        """This rank's stream positions for the step that starts at `samples_consumed`."""
        first = self._positions_before(samples_consumed) + self._rank_offset
        return np.arange(first, first + self.global_batch_size // self.dp_degree, dtype=np.int64)

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """Windows at stream `positions`, shape [len(positions), seq_len + 1]."""
        source, index = self.schedule.locate(positions)
        out = np.empty((len(positions), self.seq_len + 1), dtype=np.int64)
        for i, src in enumerate(self.sources):
            mask = source == i
            if mask.any():
                out[mask] = src.windows(index[mask])
        return out

    def _to_device(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
        labels = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
        if self.device.type == "cuda":
            return (inputs.pin_memory().to(self.device, non_blocking=True),
                    labels.pin_memory().to(self.device, non_blocking=True))
        return inputs.to(self.device), labels.to(self.device)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches (input_ids, labels), each int64 [local_batch_size, seq_len]."""
        rows = self.rows(self._positions(self.samples_consumed))
        self.samples_consumed += self.global_batch_size
        lbs = self.local_batch_size
        return [self._to_device(rows[i : i + lbs]) for i in range(0, len(rows), lbs)]

    def reset(self) -> None:
        """Back to the first step: validation scores the same batches every time."""
        self.samples_consumed = 0

    def shares(self) -> dict[str, float]:
        """Each source's share of the tokens trained on so far (empty for a single source).

        Every window has seq_len + 1 tokens, so token shares are sample shares; they are
        exact counts from the schedule, over all ranks (a stream: over this rank's samples).
        """
        if len(self.sources) == 1:
            return {}
        counts = self.schedule.counts(self._positions_before(self.samples_consumed))
        total = max(int(counts.sum()), 1)
        return {f"data/share/{label}": int(c) / total for label, c in zip(self.labels, counts)}

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "version": STATE_VERSION,
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "sources": [{**s.identity(), "weight": w} for s, w in zip(self.sources, self.weights)],
        }
        if self.rank_local:
            sd["dp_degree"] = self.dp_degree  # a streamed order is per rank: only that dp can resume it
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume at the checkpoint's sample count, after checking it points into the same
        stream: same seed, seq_len, global batch (and dp for streams), same data unless
        `allow_data_change`."""
        consumed = int(sd["samples_consumed"])
        change = f"pass --checkpoint.allow_data_change to continue from sample {consumed} on this run's data"
        if "version" not in sd:
            if not self.allow_data_change:
                raise ConfigError(
                    "cannot resume the data loader: the checkpoint was written by weft's former in-memory "
                    "loader, whose window order (a stored permutation) the memory-mapped store does not "
                    f"reproduce. Start a fresh run in a new job.dump_folder, or {change} in the new order."
                )
            logger.warning(f"data loader state from the former in-memory loader: continuing from sample "
                           f"{consumed} in the new order (checkpoint.allow_data_change)")
        mine = self.state_dict()
        keys = {"seed": "training.seed", "seq_len": "training.seq_len",
                "global_batch_size": "training.global_batch_size",
                "dp_degree": "parallelism.data_parallel_shard_degree"}
        for name, key in keys.items():
            if (name in sd or name in mine) and sd.get(name) != mine.get(name):
                raise ConfigError(
                    f"cannot resume the data loader: the checkpoint was written with {key} = "
                    f"{sd.get(name)}, this run has {mine.get(name)}. Resume with the same {key}, or "
                    "start a fresh run in a new job.dump_folder."
                )
        if "version" in sd:
            self._check_same_data(sd["sources"], mine["sources"], change)
        self.samples_consumed = consumed

    def _check_same_data(self, saved: list[dict[str, Any]], mine: list[dict[str, Any]], change: str) -> None:
        def content(sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [{k: v for k, v in s.items() if k != "name"} for s in sources]

        if content(saved) != content(mine):
            if not self.allow_data_change:
                raise ConfigError(
                    f"cannot resume the data loader: the checkpoint was trained on {_describe(saved)}, this run "
                    f"reads {_describe(mine)}. Resume with the same data, or {change}."
                )
            logger.warning(f"resuming on other data (checkpoint.allow_data_change): was {_describe(saved)}, "
                           f"now {_describe(mine)}")
        elif [s.get("name") for s in saved] != [s.get("name") for s in mine]:
            logger.info(f"the data moved: {_describe(saved)} -> same content at {_describe(mine)}")
