"""The PFLEGO paper's figure, kept by the root's rule (``algorithm.fit_test``).

With ``fit_test`` in their config, the drawn devices test the model they just trained on their own
test split and report ``fit_test_correct`` / ``fit_test_samples``, which every node sums up the tree
(hfl.node.inprocess.SUBTREE_COUNTERS). A root rule that mixes in ``DevicesOwnTest`` records the
accuracy of each global round it merges (in its stored state, so a resumed run goes on from it) and
reports the figure with its evaluation metrics: ``pflego_accuracy``, the mean of the last ``window``
rounds, and ``pflego_round_accuracy``, the last round's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

HISTORY = "fit_test_history"  # the stored per-round accuracies


def fit_test_metrics(history: Sequence[float], window: int = 10) -> dict[str, float]:
    """``pflego_accuracy`` (the mean of the last ``window`` rounds) and ``pflego_round_accuracy``
    (the last round's) from the per-round accuracies; nothing before the first."""
    if not history:
        return {}
    last = list(history[-window:])
    return {"pflego_accuracy": sum(last) / len(last), "pflego_round_accuracy": history[-1]}


def round_accuracy(metrics: Sequence[Mapping[str, Any]]) -> float | None:
    """The round's pooled accuracy from its replies' summed counts; None if no device tested."""
    tested = sum(int(m.get("fit_test_samples", 0)) for m in metrics)
    if not tested:
        return None
    return sum(int(m.get("fit_test_correct", 0)) for m in metrics) / tested


class DevicesOwnTest:
    """For a root rule (hfl.algorithm.ServerRule): call ``_load_fit_test`` in ``__init__``,
    ``_record_fit_test`` in ``aggregate``, and add ``_fit_test_state()`` / ``_fit_test_metrics()``
    to ``state()`` / ``evaluation_metrics()``. Inner nodes keep nothing."""

    fit_test_history: list[float]

    def _load_fit_test(self, state: Mapping[str, np.ndarray] | None, is_root: bool) -> None:
        self._keeps_fit_test = is_root
        stored = state.get(HISTORY) if state else None
        self.fit_test_history = [float(x) for x in stored] if stored is not None else []

    def _record_fit_test(self, replies: Any) -> None:  # noqa: ANN401 - hfl.algorithm.Replies
        if self._keeps_fit_test:
            accuracy = round_accuracy([u.metrics for u in replies.updates])
            if accuracy is not None:
                self.fit_test_history.append(accuracy)

    def _fit_test_state(self) -> dict[str, np.ndarray]:
        if not self._keeps_fit_test or not self.fit_test_history:
            return {}
        return {HISTORY: np.asarray(self.fit_test_history, dtype=np.float64)}

    def _fit_test_metrics(self) -> dict[str, float]:
        return fit_test_metrics(self.fit_test_history) if self._keeps_fit_test else {}
