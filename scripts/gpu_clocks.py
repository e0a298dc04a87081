"""SM clock and board power while a benchmark run trains, sampled with nvidia-smi.

Why: on one H200 the no-AC runs of both weft and torchtitan hold the board at its 700 W power
limit, where the SM clock falls to about 80% of its maximum (docs/performance.md, 2026-12-07).
There a step's speed depends on the energy it spends as well as on its kernels' time, so each
run's clock and power belong beside its tokens/s. A run's training steps keep the GPU busy;
compilation, data loading and start-up do not, so only samples at high utilization count.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

QUERY = "clocks.sm,power.draw,utilization.gpu"
BUSY_UTILIZATION = 90.0  # percent


def busy_medians(lines: list[str], min_utilization: float = BUSY_UTILIZATION) -> dict[str, float]:
    """Median SM clock (MHz) and board power (W) over the samples at `min_utilization` percent
    or more, from `nvidia-smi --query-gpu=clocks.sm,power.draw,utilization.gpu
    --format=csv,noheader,nounits` lines (one per GPU and sample); {} if there are none."""
    clocks, power = [], []
    for line in lines:
        try:
            mhz, watts, utilization = (float(field) for field in line.split(","))
        except ValueError:  # "[N/A]" on boards that do not report a field, or a cut-off line
            continue
        if utilization >= min_utilization:
            clocks.append(mhz)
            power.append(watts)
    if not clocks:
        return {}
    return {"sm_mhz": statistics.median(clocks), "power_w": statistics.median(power)}


class ClockSampler:
    """Samples every `interval_ms` while its `with` block runs; `result` then holds
    `busy_medians` of the samples ({} where nvidia-smi is not installed)."""

    def __init__(self, interval_ms: int = 250) -> None:
        self.interval_ms = interval_ms
        self.result: dict[str, float] = {}
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> ClockSampler:
        self.result = {}
        executable = shutil.which("nvidia-smi")
        if executable:
            self._samples = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                [executable, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=self._samples, stderr=subprocess.DEVNULL,
            )
        return self

    def __exit__(self, *exc_info) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait()
        self._proc = None
        self._samples.seek(0)
        self.result = busy_medians(self._samples.read().splitlines())
        self._samples.close()
