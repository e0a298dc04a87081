"""Shared fixtures."""

import logging
import os
import shutil
import sysconfig

import pytest


@pytest.fixture(autouse=True)
def restore_project_loggers():
    """A test that calls trainer.main.main() leaves setup_logging's handler on the project's
    loggers with propagation off, which hides every later test's records from caplog: put each
    logger back as the test found it, so that the suite's result does not depend on its order."""
    from trainer.main import PROJECT_LOGGERS

    loggers = [logging.getLogger(name) for name in PROJECT_LOGGERS]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved):
        lg.handlers, lg.level, lg.propagate = handlers, level, propagate


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
    (tests/test_parallel_parity.py uses 8, tests/test_hsdp.py both), and under "fused" the
    BASE run with the loss fused into the head (tests/test_head_loss.py)."""
    from tests.test_head_loss import FUSED
    from tests.test_parallel_parity import BASE, launch

    runs = launch(tmp_path_factory.mktemp("ref"), 1, BASE + ["--training.dataset_path", corpus],
                  [[], ["--training.global_batch_size", "16"], FUSED])
    return {8: runs[""], 16: runs["--training.global_batch_size 16"], "fused": runs[" ".join(FUSED)]}


@pytest.fixture(scope="session")
def world2(tmp_path_factory, corpus):
    """The 2-process parity jobs, trained in one launch because starting a process group costs
    ~25 s on 2 cores: tests/test_parallel_parity.py's 2-rank meshes,
    tests/test_compile_parity.py's whole-model compile on 2x1, tests/test_head_loss.py's fused
    head runs and tests/test_activation_offload.py's offloaded runs. {run args joined: metrics records}."""
    from tests.test_activation_offload import OFFLOAD_WORLD2
    from tests.test_compile_parity import WORLD2
    from tests.test_head_loss import HEAD_LOSS_WORLD2
    from tests.test_parallel_parity import BASE, WORLD2_MESHES, launch

    return launch(tmp_path_factory.mktemp("world2"), 2, BASE + ["--training.dataset_path", corpus],
                  [*WORLD2_MESHES, *WORLD2.values(), *HEAD_LOSS_WORLD2.values(), *OFFLOAD_WORLD2.values()])
