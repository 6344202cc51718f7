"""Training progress: a rich progress bar on a terminal, plain text lines otherwise.

Both show step/total, loss, tokens/s and ETA. Plain mode prints one line every
`every` steps (and at the last step), so logs of non-interactive runs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """`with Progress(total, start) as p: p.update(step, loss=..., tokens_per_s=...)`."""

    def __init__(
        self,
        total: int,
        start: int = 0,
        every: int = 10,
        stream: TextIO | None = None,
        rich: bool | None = None,
        description: str = "train",
    ) -> None:
        self.total = total
        self.start = start
        self.every = max(1, every)
        self.stream = stream or sys.stdout
        self.use_rich = self.stream.isatty() if rich is None else rich
        self.description = description
        self._t0 = time.perf_counter()
        self._bar = None
        self._task = None

    def __enter__(self) -> Progress:
        self._t0 = time.perf_counter()
        if self.use_rich:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(
                self.description, total=self.total, completed=self.start, loss="-", tps="-"
            )
        return self

    def eta(self, step: int) -> float:
        done = step - self.start
        if done <= 0:
            return float("nan")
        return (time.perf_counter() - self._t0) / done * (self.total - step)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Report that `step` steps are complete."""
        if self._bar is not None:
            self._bar.update(
                self._task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}"
            )
        elif step % self.every == 0 or step == self.total:
            eta = self.eta(step)
            eta_s = format_eta(eta) if eta == eta else "-"
            print(
                f"{self.description} step {step}/{self.total}  loss {loss:.4f}  "
                f"{tokens_per_s:,.0f} tok/s  eta {eta_s}",
                file=self.stream,
                flush=True,
            )

    def print(self, message: str) -> None:
        """A line above the bar (or a plain line)."""
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None
