"""StepReadout: a logged step's device values, staged without a sync and taken a step later."""

import pytest
import torch

from trainer.step_readout import StepReadout


def test_take_gives_the_values_as_staged_with_their_context():
    readout = StepReadout(torch.device("cpu"))
    assert readout.take() is None
    loss = torch.tensor(2.5)
    readout.stage([loss, torch.tensor(0.75, dtype=torch.float64), torch.tensor(7)], context="step 3")
    loss += 100.0  # the training loop goes on: what was staged is a copy
    values, context = readout.take()
    assert values == [2.5, 0.75, 7.0] and context == "step 3"
    assert readout.take() is None


def test_values_keep_full_precision_and_non_finite_values():
    readout = StepReadout(torch.device("cpu"))
    readout.stage([torch.tensor(1 / 3, dtype=torch.float64), torch.tensor(float("nan")), torch.tensor(2**40)], None)
    (third, nan, big), _ = readout.take()
    assert third == 1 / 3 and nan != nan and big == 2**40


def test_staging_twice_without_taking_is_an_error():
    readout = StepReadout(torch.device("cpu"))
    readout.stage([torch.tensor(1.0)], 1)
    with pytest.raises(RuntimeError, match="not taken"):
        readout.stage([torch.tensor(2.0)], 2)
    assert readout.take() == ([1.0], 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_values_are_read_after_the_queued_work():
    readout = StepReadout(torch.device("cuda"))
    x = torch.ones(4096, 4096, device="cuda")
    for _ in range(20):  # keep the GPU busy past the stage call
        x = x @ x / 4096
    readout.stage([x.sum(), x.mean()], "late")
    (total, mean), context = readout.take()
    assert total == pytest.approx(4096 * 4096) and mean == pytest.approx(1.0) and context == "late"
