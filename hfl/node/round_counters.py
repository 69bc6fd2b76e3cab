"""What a global round did, counted under the names the run's outputs carry (metrics.jsonl's
counters, samples.jsonl's rows): the root's round loop and evaluation report into it, the
recorder (hfl.output.recorder) reads it from ``RoundDone.counters``. Kept apart from the root's
strategy so that the strategy drives the round and this module alone knows the recorded names."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from flwr.common import Scalar

from hfl.node.inprocess import RoundsReport

# A level-1 node's subtree counters the root adds up as they are (bytes per edge level, seconds,
# the clock's counts per level); hfl.node.inprocess.SUBTREE_COUNTERS sums them up the tree.
SUBTREE_NAMES = ("bytes_down_team", "bytes_up_team", "compute_seconds")
SUBTREE_PREFIXES = ("bytes_down_level", "bytes_up_level", "failures_level", "late_level", "stale_level",
                    "merged_rounds_level", "empty_rounds_level", "dp_clipped_level")


def clipped_updates(report: RoundsReport) -> int:
    """How many children's updates a node's central DP clipped in its rounds (hfl.node.privacy)."""
    return sum(int(m.get("dp_clipped", 0)) for m in report.metrics)


class RoundCounters:
    """One global round's counters, from its start (``seconds`` is measured from there)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.values: dict[str, float | int | list] = {
            "bytes_down_global": 0, "bytes_up_global": 0, "bytes_down_team": 0, "bytes_up_team": 0,
            "compute_seconds": 0.0, "failures": 0}

    def __getitem__(self, key: str) -> float | int | list:
        return self.values[key]

    def add(self, key: str, value: float) -> None:
        self.values[key] = self.values.get(key, 0) + value

    def samples(self, rows: list | str) -> None:
        """A block of samples.jsonl rows (a JSON list, or the list itself)."""
        self.values.setdefault("samples", []).append(rows if isinstance(rows, str) else json.dumps(rows))

    def root_row(self, entry: dict, server_round: int) -> None:
        """One of the root's own rows of samples.jsonl."""
        self.samples([{"node": "root", "round": str(server_round), **entry}])

    def subtree(self, metrics: Mapping[str, Scalar]) -> None:
        """A level-1 node's subtree counters (bytes per edge level, seconds, the clock's counts)."""
        for key, value in metrics.items():
            if key in SUBTREE_NAMES or (key.startswith(SUBTREE_PREFIXES) and key[-1].isdigit()):
                self.add(key, value)

    def fit(self, report: RoundsReport, cohort_rows: list, timed: bool) -> None:
        """The root's round loop's report: whom it asked, the bytes of its edges, its subtrees'
        counters and samples, failures (rejected replies included) and, under a clock, its time
        and late/stale/merged/empty counts."""
        if cohort_rows:  # whom it asked, before its subtrees' records
            self.samples(cohort_rows)
        self.add("bytes_down_global", report.bytes_down)
        self.add("bytes_up_global", report.bytes_up)
        self.subtree(report.subtree)
        self.add("failures", int(report.subtree.get("device_failures", 0)))
        if report.child_samples:
            self.samples(report.child_samples)
        rejected = int(report.metrics[-1].get("rejected", 0)) if report.merged_rounds else 0
        self.add("failures", report.failures + rejected)
        self.add("failures_level1", report.failures + rejected)
        if clipped := clipped_updates(report):  # central DP at the root: its level-1 updates clipped
            self.add("dp_clipped_level1", clipped)
        if timed:
            self.values["sim_time"] = report.sim_time
            self.add("late_level1", report.late)
            self.add("stale_level1", report.stale)
            for key, count in (("merged_rounds_level0", report.merged_rounds), ("empty_rounds_level0", report.empty_rounds)):
                if count:
                    self.add(key, count)

    def merges_per_level(self) -> dict[str, dict[str, int]]:
        """This round's rounds that merged replies and those that merged nothing, per level (str)."""
        out: dict[str, dict[str, int]] = {}
        for key, value in self.values.items():
            level = key.rsplit("level", 1)[-1]
            if key.startswith(("merged_rounds_level", "empty_rounds_level")) and level.isdigit():
                out.setdefault(level, {"merged": 0, "empty": 0})[key.split("_", 1)[0]] += int(value)
        return out

    def finish(self) -> tuple[float, dict]:
        """(seconds since the round started, the counters)."""
        return time.perf_counter() - self.start, dict(self.values)
