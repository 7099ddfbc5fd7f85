"""A one-line progress bar with an ETA, shared by the commands that run many cases."""

from __future__ import annotations

import sys
import time


class Progress:
    """Redraws ``[#####.....]  i/total  label  ETA`` on stderr (nothing when ``quiet``).

    The ETA is the mean time per finished item times the items left.

    Args:
        total: number of items.
        quiet: print nothing.
        width: characters of the bar.
    """

    def __init__(self, total: int, *, quiet: bool = False, width: int = 20) -> None:
        self.total, self.quiet, self.width = max(1, total), quiet, width
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def line(self, done: float, label: str) -> str:
        """The bar after ``done`` items (a float: a fraction of the current item counts)."""
        elapsed = time.perf_counter() - self.started
        fraction = min(1.0, done / self.total)
        filled = int(self.width * fraction)
        bar = "#" * filled + "." * (self.width - filled)
        eta = f"ETA {elapsed / fraction * (1 - fraction):4.0f}s" if fraction > 0 else "ETA    ?"
        return f"[{bar}] {min(int(done) + 1, self.total):>3}/{self.total} {label} {eta}"

    def update(self, done: float, label: str) -> None:
        """Redraw the bar (on a terminal), or print the line when a whole item starts."""
        if self.quiet:
            return
        if self.tty:
            print("\r" + self.line(done, label).ljust(100), end="", file=sys.stderr, flush=True)
        elif done == int(done):
            print(self.line(done, label), file=sys.stderr, flush=True)

    def finish(self, label: str = "done") -> None:
        """Close the bar with the total time."""
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.started
        line = f"[{'#' * self.width}] {self.total:>3}/{self.total} {label} in {elapsed:.0f}s"
        print(("\r" + line.ljust(100)) if self.tty else line, file=sys.stderr, flush=True)
