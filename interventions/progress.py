"""Progress of the battery on stderr: a tqdm bar over every patched run (count, rate, ETA) on a terminal, one
plain line per stage otherwise (logs, CI), nothing with --no-progress.

The suite announces its plan (the number of patched runs of every stage, interventions.suite.run_suite) before
the first run, so the bar's ETA covers the whole battery, not one stage."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, enabled: bool = True, stream=None, prefix: str = "[interventions]"):
        self.stream = sys.stderr if stream is None else stream
        self.enabled, self.prefix = enabled, prefix
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = None
        self.total = 0
        self.done = 0
        self._stage: tuple[str, int, float, int] | None = None  # name, planned runs, start time, runs before it

    def say(self, msg: str) -> None:
        """A plain line (stage names, loading), above the bar when one is shown."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(f"{self.prefix} {msg}", file=self.stream)
        else:
            print(f"{self.prefix} {msg}", file=self.stream, flush=True)

    def plan(self, total: int) -> None:
        """Add `total` planned patched runs (the suite of one model; a control adds its own)."""
        self.total += int(total)
        if self.tty:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, unit="run", file=self.stream, dynamic_ncols=True, leave=True)
            else:
                self.bar.total = self.total
                self.bar.refresh()

    def stage(self, name: str, n_runs: int) -> None:
        self._end_stage()
        self._stage = (name, int(n_runs), time.perf_counter(), self.done)
        if self.bar is not None:
            self.bar.set_description(name)
        else:
            self.say(f"{name}: {n_runs} patched runs" if n_runs else name)

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def _end_stage(self) -> None:
        if self._stage is None:
            return
        name, _, t0, before = self._stage
        self._stage = None
        if self.bar is None and self.enabled and self.done > before:
            self.say(f"{name}: {self.done - before} runs in {time.perf_counter() - t0:.1f} s "
                     f"({self.done}/{self.total} of the battery)")

    def close(self) -> None:
        self._end_stage()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
