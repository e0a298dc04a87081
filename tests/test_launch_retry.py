"""The multi-rank launcher's one retry (tests/test_parallel_parity.launch): only a rank killed
by a signal is retried, once, from the compile-cache state the launch began with; any other
failure, and a second crash, fail the test. The driver is replaced by canned outcomes here."""

import json
import os
import subprocess

import pytest

import tests.test_parallel_parity as parity

# torchrun's report of the rank that failed first, and of one it stopped after that.
CRASH = (1, "terminate called after throwing an instance of 'gloo::EnforceNotMet'\nRoot Cause (first observed "
            "failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 7)\n")
PYTHON_ERROR = (1, "RuntimeError: shapes differ\nFailures:\n[1]:\n  exitcode  : -15 (pid: 8)\nRoot Cause (first "
                   "observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 7)\n")
SUCCESS = (0, "")


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """Replaces the torchrun launch: each call takes the next outcome, records the cache entries
    it found, and leaves one of its own, as a compiling launch would."""
    cache = tmp_path / "inductor_cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    calls, outcomes = [], []

    def run(nproc, out, base, runs):
        code, stderr = outcomes.pop(0)
        calls.append(sorted(os.listdir(cache)) if cache.is_dir() else [])
        cache.mkdir(exist_ok=True)
        (cache / f"written_by_launch_{len(calls)}").touch()
        if code == 0:
            out.write_text(json.dumps({"launch": len(calls)}))
        return subprocess.CompletedProcess([], code, "parity_driver: run 2/3: --some --run\n", stderr)

    monkeypatch.setattr(parity, "_run_driver", run)
    return cache, calls, outcomes


def test_a_crash_is_retried_from_the_cold_cache(tmp_path, driver):
    cache, calls, outcomes = driver
    outcomes += [CRASH, SUCCESS]
    with pytest.warns(UserWarning, match="killed by a signal(.|\n)*run 2/3(.|\n)*gloo::EnforceNotMet"):
        assert parity.launch(tmp_path, 4, [], [[]]) == {"launch": 2}
    assert calls == [[], []], "the retry must not see what the crashed launch cached"


def test_a_crash_is_retried_from_the_warm_cache(tmp_path, driver):
    cache, calls, outcomes = driver
    cache.mkdir()
    (cache / "from_an_earlier_launch").touch()
    outcomes += [CRASH, SUCCESS]
    with pytest.warns(UserWarning):
        assert parity.launch(tmp_path, 4, [], [[]]) == {"launch": 2}
    assert calls == [["from_an_earlier_launch"]] * 2


def test_a_python_error_is_not_retried(tmp_path, driver):
    _, calls, outcomes = driver
    outcomes.append(PYTHON_ERROR)
    with pytest.raises(pytest.fail.Exception, match="launch failed(.|\n)*run 2/3(.|\n)*shapes differ"):
        parity.launch(tmp_path, 4, [], [[]])
    assert len(calls) == 1


def test_a_second_crash_fails(tmp_path, driver):
    _, calls, outcomes = driver
    outcomes += [CRASH, CRASH]
    with pytest.warns(UserWarning), pytest.raises(pytest.fail.Exception, match="launch failed"):
        parity.launch(tmp_path, 4, [], [[]])
    assert len(calls) == 2
