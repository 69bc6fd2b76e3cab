"""metrics.jsonl / summary.json bookkeeping."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hfl.output.recorder import Recorder


def test_summary_medians_best_final_and_totals(tmp_path):
    rec = Recorder(tmp_path, {"algorithm": "permfl", "dataset": "synthetic", "model": "mclr"}, num_rounds=4)
    model = [np.zeros(2, dtype=np.float32)]
    counters = {"bytes_down_global": 10, "bytes_up_global": 5, "bytes_down_team": 100, "bytes_up_team": 50,
                "compute_seconds": 0.5, "failures": 1}
    evals = {1: {"pm_accuracy": 0.5, "gm_accuracy": 0.2, "team_accuracy": 0.3},
             3: {"pm_accuracy": 0.9, "gm_accuracy": 0.4, "team_accuracy": 0.5},
             4: {"pm_accuracy": 0.8, "gm_accuracy": 0.6, "team_accuracy": 0.7}}
    for rnd, seconds in zip((1, 2, 3, 4), (9.0, 1.0, 3.0, 2.0), strict=True):
        rec.round_done(rnd, seconds, counters, evals.get(rnd), model)  # round 2 not evaluated
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 3, 4]
    assert lines[1]["seconds"] == 3.0 and lines[1]["bytes_up_team"] == 50
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == 4
    assert summary["seconds_per_round"] == pytest.approx(2.0)  # median of 1, 3, 2: round 1 (start-up) excluded
    assert summary["total_seconds"] == pytest.approx(15.0)
    assert summary["final"] == {"pm_accuracy": 0.8, "gm_accuracy": 0.6, "team_accuracy": 0.7}
    assert summary["best"] == {"pm_accuracy": 0.9, "gm_accuracy": 0.6, "team_accuracy": 0.7}
    assert summary["total_bytes_down_team"] == 400 and summary["failures"] == 4
    with np.load(tmp_path / "checkpoints" / "global_model.npz") as ckpt:
        assert int(ckpt["round"]) == 4
