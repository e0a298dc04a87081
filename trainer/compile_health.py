"""Compile health: recompiles, graph breaks and compile time of a `torch.compile`d run.

A recompile after warm-up or a graph break silently costs throughput, so this module
turns them into numbers that are logged with every metrics record, a warning with the
reason the first time each happens, a `compile_report.txt` at the end of the run, and an
optional hard stop (`compile.max_recompiles_after_warmup`, `compile.fail_on_recompile`).

Dynamo exposes none of this publicly. Every private access lives in the `_dynamo_*`
helpers below; each degrades to "no data" when an attribute is missing rather than
failing the run. Checked against torch 2.13 (and written for the attribute names that
2.11 already has):
  - `torch._dynamo.utils.get_compilation_metrics()`: one record per frame compile
    (forward, backward and runtime records), kept in a bounded deque (64 by default).
    Fields used: `compile_id`, `co_name`, `co_filename`, `co_firstlineno`,
    `recompile_reason`, `fail_type`, `fail_reason`, `has_guarded_code`, `duration_us`
    (fallbacks `entire_frame_compile_time_s`, `backward_cumulative_compile_time_us`).
  - `torch._dynamo.utils.counters`: "graph_break" (reason -> count of graph splits),
    "resumes" (resume functions generated at those splits), "frames" ("total" frames
    Dynamo tried, "ok" the ones that did not fall back to eager) and
    "stats"/"unique_graphs".
  - The "graph_breaks" logging artifact (`torch._logging._internal.log_registry` names its
    loggers): the only place Dynamo writes a graph break's user location and reason. A
    handler is attached there; the loggers are kept from printing unless the user asked
    for them with TORCH_LOGS=graph_breaks.
  - `torch._guards.CompileContext.current_compile_id()`: ties a graph-break log line to
    its compile record.
The stance switch uses the public `torch.compiler.set_stance` (torch >= 2.6).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch._dynamo  # noqa: F401  (registers the loggers and counters read below)

from trainer.errors import TrainingStopped
from trainer.jsonl import JsonlWriter

EVENTS_FILE = "compile_events.jsonl"

logger = logging.getLogger(__name__)

_GRAPH_BREAK_ARTIFACT = "graph_breaks"


class RecompileBudgetExceeded(TrainingStopped):
    """More recompiles after warm-up than `compile.max_recompiles_after_warmup` allows."""


# ---- private Dynamo access (torch 2.13 checked; 2.11 attribute names) -------------------


def _dynamo_compile_records() -> list[Any]:
    """Dynamo's per-frame compile records currently held in its bounded deque."""
    utils = torch._dynamo.utils
    get = getattr(utils, "get_compilation_metrics", None)
    return list(get()) if get is not None else []


def _dynamo_counter_totals() -> dict[str, int]:
    """Raw cumulative counter values; see docs/metrics.md for what graph_breaks counts."""
    counters = getattr(torch._dynamo.utils, "counters", {})
    frames = counters.get("frames", {})
    # Every split leaves one "graph_break" entry and one resume function; take the larger
    # so that a split recorded by only one of the two is still counted, but once.
    splits = max(sum(counters.get("graph_break", {}).values()), sum(counters.get("resumes", {}).values()))
    eager_frames = max(frames.get("total", 0) - frames.get("ok", 0), 0)
    return {
        "graph_breaks": splits + eager_frames,
        "unique_graphs": counters.get("stats", {}).get("unique_graphs", 0),
    }


def _dynamo_current_compile_id() -> str | None:
    context = getattr(torch._guards, "CompileContext", None)
    current = getattr(context, "current_compile_id", None)
    compile_id = current() if current is not None else None
    return str(compile_id) if compile_id is not None else None


def _dynamo_graph_break_loggers() -> list[logging.Logger]:
    internal = getattr(torch._logging, "_internal", None)
    registry = getattr(internal, "log_registry", None)
    names = registry.get_artifact_log_qnames() if registry is not None else ()
    return [logging.getLogger(n) for n in sorted(names) if n.endswith(f".__{_GRAPH_BREAK_ARTIFACT}")]


def _dynamo_graph_breaks_enabled_by_user() -> bool:
    state = getattr(getattr(torch._logging, "_internal", None), "log_state", None)
    return bool(state is not None and state.is_artifact_enabled(_GRAPH_BREAK_ARTIFACT))


# ---- events ------------------------------------------------------------------------------


@dataclass
class CompileEvent:
    """One recompile or graph break as it goes into the log and compile_report.txt."""

    kind: str  # "recompile" | "graph_break"
    step: int  # step at which it was first observed
    where: str  # user location or compiled function
    summary: str  # one line for the console
    detail: str  # full reason text for the report
    after_warmup: bool = False
    allowed: str = ""  # non-empty when recorded inside allow_recompiles(why)


def _one_line(text: str, limit: int = 240) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _summarize_reason(reason: str) -> str:
    """Dynamo reasons read '<wrapper>\\n<graph-break type>\\n  Explanation: ...\\n  Hint: ...';
    keep the type and explanation."""
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.startswith("Explanation:") and i > 0:
            return _one_line(f"{lines[i - 1]}: {ln[len('Explanation:'):].strip()}")
    return _one_line(lines[0]) if lines else "unknown reason"


class _GraphBreakHandler(logging.Handler):
    """Collects Dynamo's graph-break log records (message and compile id) for the next poll."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[tuple[str | None, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f"\nGraph Break Reason: {record.exc_info[1]}"
        self.records.append((_dynamo_current_compile_id(), text))


_LOCATION = re.compile(r"in user code at (\S+:\d+)|skip tracing the frame (.+?) and fall back")


def _parse_graph_break(text: str) -> tuple[str, str, str]:
    """(where, summary, detail) from one Dynamo graph-break log message."""
    match = _LOCATION.search(text)
    where = (match.group(1) or match.group(2)) if match else "unknown location"
    reason = text.split("Graph Break Reason:", 1)[1] if "Graph Break Reason:" in text else text
    reason = reason.split("User code traceback:", 1)[0].strip()
    summary = _summarize_reason(reason)
    if "fall back to eager" in text or "falling back to eager" in text:
        summary = f"whole frame runs eagerly: {summary}"
    return where, summary, reason


# ---- the tracker -------------------------------------------------------------------------


class CompileHealth:
    """Tracks recompiles, graph breaks and compile time from the moment it is created.

    Call `check(step)` at the end of every step (it also ends the warm-up on its own after
    `compile.warmup_steps` checks, so a resumed run warms up again), merge `snapshot(step)` into each metrics record, and
    call `write_report()` then `close()` at the end of the run. Every rank tracks its own
    counts so that `check` raises on every rank; only rank 0 logs and writes the report.
    """

    def __init__(self, compile_cfg: Any, *, dump_folder: str, rank: int, start_step: int = 0) -> None:
        """`start_step`: the step the run resumes from (0 fresh). Events are also appended to
        `<dump_folder>/compile_events.jsonl`; the ones an earlier process of this run recorded
        up to `start_step` are kept and reported, later ones (steps the resumed run repeats) go."""
        self.start_step = start_step
        self._events_file: JsonlWriter | None = None
        self.earlier_events: list[CompileEvent] = []
        if rank == 0:
            os.makedirs(dump_folder, exist_ok=True)
            self._events_file = JsonlWriter(os.path.join(dump_folder, EVENTS_FILE), start_step)
            self.earlier_events = [CompileEvent(**r) for r in self._events_file.previous]
        self.warmup_steps = compile_cfg.warmup_steps
        self.max_recompiles_after_warmup = compile_cfg.max_recompiles_after_warmup
        self.fail_on_recompile = compile_cfg.fail_on_recompile
        self.dump_folder = dump_folder
        self.rank = rank
        self.events: list[CompileEvent] = []
        self.warm = False
        self.recompiles = 0
        self.recompiles_after_warmup = 0
        self.graph_breaks = 0
        self.unique_graphs = 0
        self.compile_time_s = 0.0
        self.compile_time_first_s = 0.0
        self._first_compile_step: int | None = None
        self._step = 0  # latest step seen by a poll
        self._checks = 0  # steps checked by this process
        self._recompiles_at_last_snapshot = 0
        self._allowed: str = ""
        self._stance_set = False
        self._seen_breaks: set[tuple[str, str]] = set()
        self._frames: dict[str, str] = {}  # frame id ("3" of compile id "3/1") -> "fn (file:line)"
        self._known = {id(r): r for r in _dynamo_compile_records()}
        self._overflow_warned = False
        self._raw = _dynamo_counter_totals()
        self._handler = _GraphBreakHandler()
        self._logger_state: list[tuple[logging.Logger, int, bool]] = []
        user_enabled = _dynamo_graph_breaks_enabled_by_user()
        for lg in _dynamo_graph_break_loggers():
            self._logger_state.append((lg, lg.level, lg.propagate))
            lg.addHandler(self._handler)
            if not user_enabled:
                lg.setLevel(logging.DEBUG)
                lg.propagate = False  # ours only: do not print what the user did not ask for

    # -- collection --

    def _poll(self, step: int | None = None) -> None:
        """Fold everything Dynamo recorded since the last poll into the counts and events,
        attributing new events to `step` (default: the latest step seen)."""
        step = self._step = self._step if step is None else step
        compile_ids_with_break = self._take_graph_break_records(step)
        records = _dynamo_compile_records()
        new = [r for r in records if id(r) not in self._known]
        if self._known and records and len(new) == len(records) and not self._overflow_warned:
            self._overflow_warned = True
            self._warn(
                "Dynamo dropped compile records between two checks (more compiles than it keeps); "
                "recompile counts and compile time may be low. Call check(step) every step."
            )
        self._known = {id(r): r for r in records}
        step_compile_time = 0.0
        for r in new:
            step_compile_time += _record_seconds(r)
            self._note_record(r, step, compile_ids_with_break)
        self.compile_time_s += step_compile_time
        if step_compile_time > 0 and self._first_compile_step is None:
            self._first_compile_step = step
        if step == self._first_compile_step:
            self.compile_time_first_s += step_compile_time
        raw = _dynamo_counter_totals()
        for key, value in raw.items():
            # A drop means someone cleared the counters (e.g. a test); count from zero again.
            delta = value - self._raw[key] if value >= self._raw[key] else value
            setattr(self, key, getattr(self, key) + delta)
        self._raw = raw

    def _take_graph_break_records(self, step: int) -> set[str]:
        taken, self._handler.records = self._handler.records, []
        compile_ids: set[str] = set()
        for compile_id, text in taken:
            if compile_id is not None:
                compile_ids.add(compile_id)
            self._add_graph_break(step, *_parse_graph_break(text))
        return compile_ids

    def _note_record(self, r: Any, step: int, compile_ids_with_break: set[str]) -> None:
        compile_id = str(getattr(r, "compile_id", None) or "?")
        frame_id = compile_id.split("/")[0]
        if getattr(r, "co_name", None):
            self._frames[frame_id] = _frame_label(r.co_name, r.co_filename, r.co_firstlineno)
        where = self._frames.get(frame_id, f"frame {frame_id}")
        reason = getattr(r, "recompile_reason", None)
        if reason is not None:
            self.recompiles += 1
            after = self.warm and not self._allowed
            self.recompiles_after_warmup += int(after)
            self._add(
                CompileEvent(
                    kind="recompile",
                    step=step,
                    where=f"{where} [compile {compile_id}]",
                    summary=_one_line(reason),
                    detail=reason,
                    after_warmup=self.warm,
                    allowed=self._allowed,
                )
            )
        fail_type = getattr(r, "fail_type", None)
        if fail_type and not getattr(r, "has_guarded_code", False) and compile_id not in compile_ids_with_break:
            detail = f"{fail_type}: {getattr(r, 'fail_reason', '') or ''}"
            self._add_graph_break(step, where, f"whole frame runs eagerly: {_summarize_reason(detail)}", detail)

    def _add_graph_break(self, step: int, where: str, summary: str, detail: str) -> None:
        key = (where, summary)
        if key in self._seen_breaks:
            return  # the same break seen again by a recompile of its frame: already reported
        self._seen_breaks.add(key)
        self._add(CompileEvent("graph_break", step, where, summary, detail, after_warmup=self.warm))

    def _add(self, event: CompileEvent) -> None:
        self.events.append(event)
        if self._events_file is not None:
            self._events_file.write(dataclasses.asdict(event))
        label = "recompile" if event.kind == "recompile" else "graph break"
        note = " after warm-up" if event.after_warmup else ""
        if event.allowed:
            note += f" (allowed: {event.allowed})"
        self._warn(f"torch.compile {label}{note} at step {event.step} in {event.where}: {event.summary}")

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            logger.warning(message)

    # -- public API --

    def snapshot(self, step: int) -> dict[str, float]:
        """Compile-health fields for the metrics record of `step`."""
        self._poll(step)
        since = self.recompiles - self._recompiles_at_last_snapshot
        self._recompiles_at_last_snapshot = self.recompiles
        return {
            "recompiles": self.recompiles,
            "recompiles_since_log": since,
            "recompiles_after_warmup": self.recompiles_after_warmup,
            "graph_breaks": self.graph_breaks,
            "unique_graphs": self.unique_graphs,
            "compile_time_s": self.compile_time_s,
            "compile_time_first_s": self.compile_time_first_s,
        }

    def end_warmup(self, step: int | None = None) -> None:
        """Mark the end of warm-up: later recompiles count against the budget, and with
        `compile.fail_on_recompile` any further compilation raises (stance
        "fail_on_recompile" also refuses first compiles of frames not seen during warm-up).
        Idempotent."""
        if self.warm:
            return
        self._poll(step)  # what compiled during warm-up belongs to warm-up
        self.warm = True
        if self.fail_on_recompile:
            torch.compiler.set_stance("fail_on_recompile")
            self._stance_set = True

    def check(self, step: int) -> None:
        """Call at the end of every step. Raises RecompileBudgetExceeded once more than
        `compile.max_recompiles_after_warmup` recompiles happened after warm-up."""
        self._poll(step)
        self._checks += 1
        if not self.warm and self._checks >= self.warmup_steps:
            self.end_warmup(step)
        budget = self.max_recompiles_after_warmup
        if budget is None or self.recompiles_after_warmup <= budget:
            return
        reasons = "\n".join(
            f"  - step {e.step}, {e.where}: {e.summary}"
            for e in self.events
            if e.kind == "recompile" and e.after_warmup and not e.allowed
        )
        raise RecompileBudgetExceeded(
            f"{self.recompiles_after_warmup} recompiles after warm-up (step {step}) exceed "
            f"compile.max_recompiles_after_warmup={budget}. Reasons:\n{reasons}\n"
            "Fix the cause (usually a changing shape, dtype or grad mode), or raise or unset "
            "compile.max_recompiles_after_warmup."
        )

    @contextlib.contextmanager
    def allow_recompiles(self, why: str) -> Iterator[None]:
        """Recompiles inside are expected (e.g. the first validation pass under no_grad):
        they are counted and reported but not held against the budget, and the
        fail_on_recompile stance is lifted meanwhile."""
        self._poll()
        self._allowed = why
        try:
            if self._stance_set:
                with torch.compiler.set_stance("default"):
                    yield
            else:
                yield
        finally:
            self._poll()
            self._allowed = ""

    def write_report(self) -> str | None:
        """Write <dump_folder>/compile_report.txt on rank 0; returns its path."""
        self._poll()
        if self.rank != 0:
            return None
        path = os.path.join(self.dump_folder, "compile_report.txt")
        os.makedirs(self.dump_folder, exist_ok=True)
        lines = [
            "torch.compile report",
            f"recompiles: {self.recompiles} (after warm-up of {self.warmup_steps} steps: "
            f"{self.recompiles_after_warmup}, budget: {self.max_recompiles_after_warmup})",
            f"graph breaks: {self.graph_breaks}",
            f"unique graphs: {self.unique_graphs}",
            f"compile time: {self.compile_time_s:.2f} s total, {self.compile_time_first_s:.2f} s "
            f"in the first compiling step (step {self._first_compile_step})",
            "",
        ]
        if self.earlier_events:
            lines.append(
                f"This process resumed the run at step {self.start_step}; the counts above are its own. "
                f"Events recorded by earlier processes up to step {self.start_step} are listed first."
            )
            lines.append("")
        for kind, title in (("recompile", "Recompiles"), ("graph_break", "Graph breaks")):
            events = [e for e in self.earlier_events + self.events if e.kind == kind]
            lines.append(f"== {title} ({len(events)} distinct) ==")
            for e in events:
                flags = " after warm-up" if e.after_warmup else ""
                flags += f" (allowed: {e.allowed})" if e.allowed else ""
                lines.append(f"[step {e.step}{flags}] {e.where}: {e.summary}")
                if e.detail.strip() != e.summary:
                    lines.extend("    " + ln for ln in e.detail.strip().splitlines())
                    lines.append("")
            lines.append("")
        with open(path, "w") as f:
            f.write("\n".join(lines))
        return path

    def close(self) -> None:
        """Detach from Dynamo's loggers, lift the fail_on_recompile stance, close the events file."""
        if self._events_file is not None:
            self._events_file.close()
            self._events_file = None
        for lg, level, propagate in self._logger_state:
            lg.removeHandler(self._handler)
            lg.setLevel(level)
            lg.propagate = propagate
        self._logger_state = []
        if self._stance_set:
            torch.compiler.set_stance("default")
            self._stance_set = False


_TORCH_DIR = os.path.dirname(torch.__file__)


def _frame_label(name: str, filename: str | None, line: int | None) -> str:
    """Name a compiled frame. A compiled nn.Module runs through a wrapper inside torch
    (`inner` in torch/_dynamo/external_utils.py), whose path would only mislead."""
    if filename and filename.startswith(_TORCH_DIR):
        return f"a torch.compile'd module (Dynamo wrapper '{name}')"
    return f"{name} ({filename}:{line})"


def _record_seconds(r: Any) -> float:
    """Compile seconds of one Dynamo compile record (forward, backward or runtime)."""
    duration_us = getattr(r, "duration_us", None)
    if duration_us is not None:
        return duration_us / 1e6
    seconds = getattr(r, "entire_frame_compile_time_s", None)
    if seconds is not None:
        return float(seconds)
    backward_us = getattr(r, "backward_cumulative_compile_time_us", None)
    return backward_us / 1e6 if backward_us is not None else 0.0
