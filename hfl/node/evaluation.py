"""Evaluation counts that add up at any depth.

A node reports, per model level it tested (``gm``, ``level1``, ``level2``…, ``pm``; ``team``
is today's name of ``level1``), Σcorrect, Σn, Σloss and the per-device triples. Adding two
reports is adding these sums, so a subtree's report is the sum of its children's and the
root's pooled accuracy is Σcorrect / Σn over every device, whatever the depth.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from flwr.common import Scalar

LEVEL_ALIASES = {"team": "level1"}  # 3-tier runs and deployments name level 1 "team"
# <level>_client_mean_accuracy: the unweighted mean of the devices' accuracies (hfl.output.report shows
# it as a figure of its own, not as a model level).
CLIENT_MEAN = "client_mean"
Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile: a two-sided 95 % interval


class DeviceScore(NamedTuple):
    device_id: int
    correct: int
    n: int
    loss: float  # mean over the device's n test samples


def target_report(target: str, rows: list[DeviceScore]) -> dict[str, Scalar]:
    """One model's evaluation over some devices, as counts a parent can add to others."""
    return {
        f"{target}_correct": sum(r.correct for r in rows),
        f"{target}_n": sum(r.n for r in rows),
        f"{target}_loss_sum": sum(r.loss * r.n for r in rows),
        f"{target}_devices": json.dumps([(r.device_id, r.correct, r.n) for r in rows]),
    }


def targets_of(report: Mapping[str, Scalar]) -> list[str]:
    """The model levels a report holds counts for."""
    return [key[: -len("_n")] for key in report if key.endswith("_n") and f"{key[:-2]}_correct" in report]


def add_reports(reports: Sequence[Mapping[str, Scalar]]) -> dict[str, Scalar]:
    """The report of a subtree: the sum of its children's (per-device triples concatenated)."""
    out: dict[str, Scalar] = {}
    for target in dict.fromkeys(t for r in reports for t in targets_of(r)):
        having = [r for r in reports if f"{target}_n" in r]
        out[f"{target}_correct"] = sum(int(r[f"{target}_correct"]) for r in having)
        out[f"{target}_n"] = sum(int(r[f"{target}_n"]) for r in having)
        out[f"{target}_loss_sum"] = sum(float(r[f"{target}_loss_sum"]) for r in having)
        out[f"{target}_devices"] = json.dumps([row for r in having for row in json.loads(str(r[f"{target}_devices"]))])
    return out


def evaluation_result(metrics: dict[str, Scalar], global_model: bool) -> tuple[float, int, dict[str, Scalar]]:
    """A node's evaluate() reply: Flower's loss and count are GM's, or PM's without a global model."""
    main = "gm" if global_model else "pm"
    n = int(metrics.get(f"{main}_n", 0))
    if n == 0:
        raise RuntimeError(f"node {metrics.get('node')}: no device evaluated the {main.upper()} model")
    return float(metrics[f"{main}_loss_sum"]) / n, n, metrics


def _canonical(report: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """``team_*`` counts renamed ``level1_*``."""
    out = {}
    for key, value in report.items():
        target, _, rest = key.partition("_")
        out[f"{LEVEL_ALIASES.get(target, target)}_{rest}" if rest else key] = value
    return out


def _level_order(target: str) -> tuple[int, int]:
    if target == "pm":
        return (0, 0)
    if target.startswith("level") and target[5:].isdigit():
        return (1, int(target[5:]))
    return (2, 0)  # gm


def accuracy_interval(rows: Sequence[tuple[float, float]], population: int,
                      z: float = Z95) -> tuple[float, float] | None:
    """A 95 % interval of the pooled accuracy p = Σc / Σn of ``rows`` (correct, n), one per device,
    when those m devices are a sample of ``population``: the normal interval of a ratio estimator
    with the devices as the sampling units (a device's test samples are not independent draws, so
    a binomial interval on Σn would be too narrow when devices differ),
    p ± z · sqrt((1 - m/M) · s² / m) / n̄,  s² = Σ(c_i - p·n_i)² / (m - 1),  n̄ = Σn / m,
    clipped to [0, 1]; the finite-population factor makes it the point itself when m = M.
    None for fewer than 2 devices (no spread to estimate) or no sample. Rows (a_i, 1) give the
    interval of the devices' mean accuracy (the client mean). The pooled figure is weighted by
    test size: where a few devices hold much of the data (Synthetic's lognormal sizes: 1 % of the
    devices hold a third of the samples) a small device sample seldom holds them, and its interval
    covers the federation's figure less often than 95 %; the client mean's does not depend on sizes."""
    m = len(rows)
    total = sum(n for _, n in rows)
    if m < 2 or total == 0:
        return None
    p = sum(c for c, _ in rows) / total
    spread = sum((c - p * n) ** 2 for c, n in rows) / (m - 1)
    finite = max(0.0, 1.0 - m / population)
    half = z * math.sqrt(finite * spread / m) / (total / m)
    return max(0.0, p - half), min(1.0, p + half)


def pool_evaluations(reports: Sequence[Mapping[str, Scalar]], population: int | None = None) -> dict[str, float | None]:
    """Pool the level-1 nodes' reports into accuracy = Σcorrect / Σsamples (loss likewise),
    the spread of per-device accuracies and their unweighted mean
    (``<level>_client_mean_accuracy``: every device counts once, whatever its test size), for
    every model level present. ``team`` and ``level1`` are the same level: both keys are
    written. pm, gm and team are always present (None where the algorithm has no such model)
    so that every run's lines share keys; so is ``client_mean_accuracy``, PM's client mean
    (the FeMAM paper's figure), None without a PM.

    ``population``: the federation's devices, given where evaluation is sampled (top-level
    ``eval_fraction``). Each model level tested on fewer devices than that also reports the
    devices and test samples behind its figure (``<level>_eval_devices``, ``<level>_eval_samples``)
    and 95 % intervals of its accuracy (``<level>_accuracy_ci_low`` / ``_ci_high``) and of its
    client mean (``<level>_client_mean_accuracy_ci_low`` / ``_ci_high``) (``accuracy_interval``);
    a full evaluation's lines are as they always were."""
    total = add_reports([_canonical(r) for r in reports])
    pooled: dict[str, float | None] = {}
    targets = sorted(set(targets_of(total)) | {"pm", "gm", "level1"}, key=_level_order)
    for target in targets:
        n = int(total.get(f"{target}_n", 0))
        if n == 0:
            pooled[f"{target}_accuracy"] = pooled[f"{target}_loss"] = None
            continue
        pooled[f"{target}_accuracy"] = int(total[f"{target}_correct"]) / n
        pooled[f"{target}_loss"] = float(total[f"{target}_loss_sum"]) / n
        rows = [(c, k) for _, c, k in json.loads(str(total[f"{target}_devices"]))]
        per_device = [c / k for c, k in rows]
        pooled[f"{target}_accuracy_min"] = min(per_device)
        pooled[f"{target}_accuracy_median"] = statistics.median(per_device)
        pooled[f"{target}_accuracy_max"] = max(per_device)
        pooled[f"{target}_{CLIENT_MEAN}_accuracy"] = statistics.fmean(per_device)
        if population is not None and len(rows) < population:
            pooled[f"{target}_eval_devices"], pooled[f"{target}_eval_samples"] = len(rows), n
            pooled[f"{target}_accuracy_ci_low"], pooled[f"{target}_accuracy_ci_high"] = \
                accuracy_interval(rows, population) or (None, None)
            mean = f"{target}_{CLIENT_MEAN}_accuracy"
            pooled[f"{mean}_ci_low"], pooled[f"{mean}_ci_high"] = \
                accuracy_interval([(a, 1) for a in per_device], population) or (None, None)
    for key in [k for k in pooled if k.startswith("level1_")]:
        pooled["team_" + key[len("level1_"):]] = pooled[key]
    pooled[f"{CLIENT_MEAN}_accuracy"] = pooled.get(f"pm_{CLIENT_MEAN}_accuracy")
    return pooled
