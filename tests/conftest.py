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
