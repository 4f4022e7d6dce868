"""The main job's live display: a line per row as it finishes, and one progress bar for the
whole job with the time left.  rich where it is installed, else tqdm, else plain text (a
line per finished row and a text bar at most every ``PLAIN_EVERY_S`` seconds)."""

from __future__ import annotations

import re
import sys
import time

PLAIN_EVERY_S = 60.0


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def time_left(elapsed_s: float, done: float, total: float) -> float | None:
    """Seconds left at the pace so far (rows done, fractions of the current one counted);
    None before anything is done."""
    if done <= 0:
        return None
    return elapsed_s / done * max(0.0, total - done)


def text_bar(done: float, total: float, elapsed_s: float, width: int = 24) -> str:
    """``[#########...............] 5.2/21 rows, 3:02 elapsed, ~9:40 left``."""
    frac = 0.0 if total <= 0 else min(1.0, done / total)
    n = round(frac * width)
    left = time_left(elapsed_s, done, total)
    return (f"[{'#' * n}{'.' * (width - n)}] {done:.1f}/{total:g} rows, {_clock(elapsed_s)} "
            f"elapsed, " + ("time left unknown" if left is None else f"~{_clock(left)} left"))


class Display:
    """``row(label, fraction)`` while a row runs; ``done(line)`` when it finishes."""

    def __init__(self, console, total_rows: int):
        self.console, self.total = console, total_rows
        self.finished, self.current = 0, 0.0
        self.t0 = time.monotonic()
        self.last_plain = self.t0
        self.kind = "plain"
        self._rich = self._tqdm = None

    def __enter__(self):
        try:
            from rich.progress import (
                BarColumn,
                Progress,
                TaskProgressColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            if not hasattr(self.console, "is_terminal"):
                raise ImportError("not a rich console")
            self._rich = Progress("{task.description}", BarColumn(bar_width=20),
                                  TaskProgressColumn(), TimeElapsedColumn(),
                                  TimeRemainingColumn(), console=self.console)
            self._rich.__enter__()
            self._task = self._rich.add_task("rows", total=self.total)
            self.kind = "rich"
            return self
        except ImportError:
            pass
        try:
            from tqdm import tqdm

            # a log (not a terminal) gets a bar every 30 s, not one per progress update
            self._tqdm = tqdm(total=self.total, unit="row", file=sys.stdout, ncols=78,
                              mininterval=0.5 if sys.stdout.isatty() else 30.0,
                              bar_format="{desc} {bar} {n:.1f}/{total} "
                                         "[{elapsed}<{remaining}]")
            self.kind = "tqdm"
        except ImportError:
            pass
        return self

    def __exit__(self, *exc):
        if self._rich is not None:
            self._rich.__exit__(*exc)
        if self._tqdm is not None:
            self._tqdm.close()
        return None

    def _show(self, desc: str) -> None:
        done = self.finished + self.current
        if self._rich is not None:
            self._rich.update(self._task, completed=done, description=desc[:28])
        elif self._tqdm is not None:
            self._tqdm.n = done
            self._tqdm.set_description_str(desc[:24], refresh=False)
            self._tqdm.update(0)         # redraws when mininterval has passed
        elif time.monotonic() - self.last_plain >= PLAIN_EVERY_S:
            self.last_plain = time.monotonic()
            print(f"{desc}: " + text_bar(done, self.total, self.last_plain - self.t0),
                  flush=True)

    def row(self, label: str, fraction: float) -> None:
        """The row now running and how far it is (0..1)."""
        self.current = min(0.99, max(0.0, fraction))
        self._show(label)

    def done(self, line: str) -> None:
        """A row finished: its line now, above the bar."""
        self.finished, self.current = self.finished + 1, 0.0
        if self._rich is not None:
            self._rich.console.print(line, markup=False, highlight=False)
        elif self._tqdm is not None:
            self._tqdm.write(line)
        else:
            print(re.sub(r"\s+$", "", line), flush=True)
            print("  " + text_bar(self.finished, self.total, time.monotonic() - self.t0),
                  flush=True)
            self.last_plain = time.monotonic()
        self._show("rows")
