"""Where a run's time goes: each ledger step's kind, wall time, device time and host phases, and
the time between steps; ``floor.breakdown`` sets them beside each kind's floor.

With the step ledger on (``Engine.enable_step_ledger``), the engine times every step it runs
(``StepTime``, one per ``StepRecord``, same order):

- ``kind`` (``StepKind``): decode-only or mixed (prefill rows with or without decode rows), the
  batch bucket (decode rows) or token bucket (every row) it belongs to, whether it has LoRA or
  DoRA rows, and how it ran (a captured graph, the padded pieces run eagerly, or one eager forward);
- ``start`` / ``end``: host clock (``time.perf_counter``) from the step's start (after admission)
  to its end, the span ``Engine.stats()["step_seconds_total"]`` sums; ``gap_s``: host time from
  the previous step's end to this step's start (admission, the loop, idle waiting for arrivals);
- host phases inside the step: ``schedule_s`` (scheduler), ``launch_s`` (batch tables, the
  forward and sampling launched, the sampled tokens' copies queued), ``wait_s`` (blocked reading
  sampled tokens: the device still busy), ``emit_s`` (detokenize, stop checks, events);
- on CUDA, two timing events around the step's device work (recorded at the launch's start and
  end, read only by ``floor.breakdown``, so nothing waits for them during the run): ``gpu_s`` (the
  device's span of the step) and ``gpu_gap_s`` (the device idle between the previous step's end
  and this step's start). On a CPU there are no events and ``gpu_s`` is None: the breakdown uses
  the wall time instead.

With the overlapped decode a call of ``Engine.step`` launches one step and reads the previous
one's tokens: its wall time, phases and kind are those of the step it launched (the reading is
its ``wait_s`` and ``emit_s``); the last call of a run reads the last step without launching
one, counted as ``drain_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StepKind:
    """``phase``: "decode" (decode rows only) or "mixed" (prefill rows, maybe decode rows too);
    ``bucket``: the batch bucket of a decode step, the token bucket of a mixed step (its token
    count where it exceeds every bucket); ``adapters``: "base", "lora" or "dora" (DoRA rows
    present); ``mode``: "graph" (captured), "pieces" (the padded pieces, eager) or "eager"."""

    phase: str
    bucket: int
    adapters: str
    mode: str

    @property
    def label(self) -> str:
        return f"{self.phase} {'b' if self.phase == 'decode' else 't'}{self.bucket} {self.adapters} {self.mode}"


@dataclass
class StepTime:
    """One step's times (see the module docstring); seconds, host clock unless named gpu."""

    kind: StepKind | None
    start: float
    end: float
    gap_s: float
    schedule_s: float = 0.0
    launch_s: float = 0.0
    wait_s: float = 0.0
    emit_s: float = 0.0
    events: tuple[Any, Any] | None = None  # CUDA timing events at the launch's start and end
    gpu_s: float | None = None
    gpu_gap_s: float | None = None

    @property
    def wall_s(self) -> float:
        return self.end - self.start


class StepClock:
    """The ledger's timer: ``begin`` at a step's start, phases added while it runs, ``launched``
    when its device work is queued, ``end`` once it is over; ``drain`` for a call that only read
    the last launched step. ``cuda``: record timing events around each step's device work (on
    ``device``'s current stream)."""

    def __init__(self, cuda: bool, device: torch.device | str | None = None) -> None:
        self.cuda = cuda
        self.device = device  # (CUDA: the events go on this device's current stream)
        self.times: list[StepTime] = []
        self.drain_s = 0.0
        self.gap_s = 0.0  # host time between steps and reads, in all
        self._last_end: float | None = None
        self._gap_before_drain = 0.0
        self._open: StepTime | None = None
        self._phases = {"schedule_s": 0.0, "wait_s": 0.0, "emit_s": 0.0}  # before begin (e.g. a read)

    @property
    def last_end(self) -> float | None:
        """Host clock at the end of the last step or read."""
        return self._last_end

    def add(self, phase: str, seconds: float) -> None:
        """Add ``seconds`` of host time to ``phase`` of the step under way."""
        if self._open is not None:
            setattr(self._open, phase, getattr(self._open, phase) + seconds)
        else:
            self._phases[phase] = self._phases.get(phase, 0.0) + seconds

    def begin(self, start: float) -> None:
        gap = self._gap_before_drain + self._gap_since_last(start)
        self._gap_before_drain = 0.0
        self._open = StepTime(kind=None, start=start, end=start, gap_s=gap, **self._phases)
        self._phases = {k: 0.0 for k in self._phases}
        self._launch_t0 = time.perf_counter()
        if self.cuda:
            first = torch.cuda.Event(enable_timing=True)
            first.record(torch.cuda.current_stream(self.device))
            self._open.events = (first, None)

    def launched(self) -> None:
        """The step's device work is queued (idempotent)."""
        step = self._open
        if step is None or step.launch_s:
            return
        step.launch_s = max(time.perf_counter() - self._launch_t0, 1e-12)
        if step.events is not None:
            last = torch.cuda.Event(enable_timing=True)
            last.record(torch.cuda.current_stream(self.device))
            step.events = (step.events[0], last)

    def end(self, end: float, kind: StepKind | None) -> None:
        self.launched()
        step, self._open = self._open, None
        if step is None:
            return
        step.end, step.kind = end, kind
        self.times.append(step)
        self._last_end = end

    def drop_phases(self) -> None:
        """A call that ran no step: its host phases are time between steps."""
        self._phases = {k: 0.0 for k in self._phases}

    def drain(self, start: float, end: float) -> None:
        """A call that read the last launched step's tokens and launched nothing."""
        self.drain_s += end - start
        self._phases = {k: 0.0 for k in self._phases}
        self._gap_before_drain += self._gap_since_last(start)
        self._last_end = end

    def _gap_since_last(self, start: float) -> float:
        """Host time between the last step's or read's end and ``start``, added to ``gap_s``."""
        gap = 0.0 if self._last_end is None else max(0.0, start - self._last_end)
        self.gap_s += gap
        return gap

    def resolve(self) -> None:
        """Read the CUDA events into ``gpu_s`` / ``gpu_gap_s`` (waits for the last step's end)."""
        previous = None
        for t in self.times:
            if t.events is not None and t.events[1] is not None:
                if t.gpu_s is None:
                    t.events[1].synchronize()
                    t.gpu_s = t.events[0].elapsed_time(t.events[1]) / 1e3
                    if previous is not None:
                        t.gpu_gap_s = max(0.0, previous.elapsed_time(t.events[0]) / 1e3)
                previous = t.events[1]


def breakdown_table(report: dict[str, Any]) -> str:
    """``floor.breakdown``'s result as a table, by kind, then the totals and the time between steps."""
    gpu = report["gpu_times"]
    head = (f"  {'step kind':<26} {'steps':>6} {'tok/step':>8} {'wall s':>8} {'GPU s':>8} {'floor s':>8} "
            f"{'floor/' + ('GPU' if gpu else 'wall'):>10} {'sched ms':>9} {'launch ms':>9} {'wait ms':>9} "
            f"{'emit ms':>9}")
    lines = [head]

    def line(r: dict[str, Any]) -> str:
        per = 1e3 / max(r["steps"], 1)  # host phases: ms per step
        return (f"  {r['kind']:<26} {r['steps']:>6} {r.get('tokens', 0) * per / 1e3:>8.0f} {r['wall_s']:>8.4g} {_f(r['gpu_s'], '8.4g')} "
                f"{r['floor_s']:>8.4g} {_f(r['floor_over_gpu'], '10.1%')} {r['schedule_s'] * per:>9.2f} "
                f"{r['launch_s'] * per:>9.2f} {r['wait_s'] * per:>9.2f} {r['emit_s'] * per:>9.2f}")

    lines += [line(r) for r in report["kinds"]]
    t = report["total"]
    lines.append(line(t))
    lines.append(f"  between steps: host {t['gap_s']:.4g} s, reads of the last launched step {t['drain_s']:.4g} s"
                 + (f", device idle {t['gpu_gap_s']:.4g} s" if gpu else ""))
    return "\n".join(lines)


def _f(x: float | None, spec: str) -> str:
    return f"{'-':>{int(spec.split('.')[0])}}" if x is None else format(x, spec)
