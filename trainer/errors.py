"""The mistakes and stops a user sees, each with its exit code; `trainer/main.py` maps them.

Every error here carries a message written for the user (what is wrong, which key or file,
and the fix), is printed once by rank 0 as one line, and ends the process with `exit_code`:
2 for something the user must change before running again (config, checkpoint, data), 1 for
a run that started and had to stop (non-finite values, a full disk, a recompile budget).
"""

from __future__ import annotations


class WeftError(Exception):
    """Base of every user-facing error; `label` prefixes the printed line."""

    exit_code = 1
    label = "error"


class ConfigError(WeftError, ValueError):
    """A configuration mistake the user can fix; the message says how."""

    exit_code = 2
    label = "config error"


class CheckpointError(WeftError):
    """A checkpoint this run cannot use (other model, corrupt, missing step, refused content)."""

    exit_code = 2
    label = "checkpoint error"


class DataError(WeftError, ValueError):
    """Training data that cannot be read or does not fit the model (bad file, id past the vocab)."""

    exit_code = 2
    label = "data error"


class DumpFolderInUse(WeftError):
    """Another run holds `job.dump_folder`."""

    exit_code = 2
    label = "dump folder in use"


class TrainingStopped(WeftError):
    """The run started but cannot go on (non-finite values, recompile budget, full disk)."""

    exit_code = 1
    label = "stopped"


class NonFiniteError(TrainingStopped):
    """The loss, gradient norm or parameters became NaN/Inf; nothing poisoned is saved."""


class CheckpointWriteError(TrainingStopped):
    """A save could not be written (e.g. the disk is full); its partial folder is removed and
    the previous checkpoint is kept."""
