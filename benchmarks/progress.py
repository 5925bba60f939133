"""The progress bar of long benchmark runs: tqdm's, or where tqdm is not installed (a TPU host used as it is), a
plain line per step on stderr with the same interface (total, update, set_description, refresh, write)."""

from __future__ import annotations

import sys
import time


class PlainBar:
    """What the benchmarks use of tqdm's bar, printed as "[n/total] description (elapsed)" lines."""

    def __init__(self, total=0, unit="step", file=None, **_):
        self.total, self.n, self.unit = total, 0, unit
        self.file = file or sys.stderr
        self.description = ""
        self.start = time.monotonic()

    def set_description(self, description: str) -> None:
        self.description = description

    def refresh(self) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        elapsed = time.monotonic() - self.start
        print(f"[{self.n}/{self.total} {self.unit}s] {self.description} ({elapsed:.0f} s)", file=self.file, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def bar(**kwargs):
    """tqdm(**kwargs) where tqdm is installed, else a PlainBar."""
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainBar(**kwargs)
    return tqdm(**kwargs)
