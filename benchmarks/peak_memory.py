"""Peak resident memory of a process and all its descendants (Ray's raylet, GCS and actors a
local ``ray.init`` starts are children of the driver), sampled by psutil in a thread.

    with PeakMemory() as peak:
        run(...)
    print(peak.gib)
"""

from __future__ import annotations

import threading

import psutil


class PeakMemory:
    """The largest sum of RSS over this process and its descendants seen while the block ran."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def sample(self) -> int:
        me = psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # a worker that ended between listing and reading
        return total

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self.peak = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.sample())

    @property
    def gib(self) -> float:
        return self.peak / 2**30
