"""Wall time per model-load phase, printed to stderr when ``VT_LOAD_STATS=1``.

stats = LoadStats()
with stats.phase("config"):
    ...
with stats.phase("weights"):
    ...
stats.report()   # "[vllmpy load] weights          12.268 s", one line per phase
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from vllmpy import envs


class LoadStats:
    """Records the wall time of named load phases, in the order they first ran.

    A phase entered more than once accumulates its time. A phase that raises is still
    recorded, up to the raise.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed

    def lines(self) -> list[str]:
        """One formatted line per phase."""
        return [f"[vllmpy load] {name:<16} {secs:.3f} s" for name, secs in self.seconds.items()]

    def report(self, file: TextIO | None = None) -> None:
        """Print one line per phase to ``file`` (stderr), only when ``VT_LOAD_STATS`` is on."""
        if not envs.VT_LOAD_STATS:
            return
        out = file if file is not None else sys.stderr
        for line in self.lines():
            print(line, file=out)
        out.flush()
