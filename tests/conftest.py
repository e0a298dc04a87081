"""Shared fixtures."""

import os
import shutil
import sysconfig

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in ("abc.py", "bisect.py", "colorsys.py", "copy.py", "dataclasses.py", "fnmatch.py", "heapq.py"):
        shutil.copy(os.path.join(stdlib, name), folder / f"{name}.txt")
    return str(folder)


@pytest.fixture(scope="session")
def references(tmp_path_factory, corpus):
    """The 1-process runs the multi-rank parity tests compare against, trained once for the suite:
    {global batch size: metrics records} for tests/test_parallel_parity.py's BASE at 8 and 16
    (tests/test_parallel_parity.py uses 8, tests/test_hsdp.py both)."""
    from tests.test_parallel_parity import BASE, launch

    runs = launch(tmp_path_factory.mktemp("ref"), 1, BASE + ["--training.dataset_path", corpus],
                  [[], ["--training.global_batch_size", "16"]])
    return {8: runs[""], 16: runs["--training.global_batch_size 16"]}

