"""One short run per baseline on the small synthetic federation (in-process runtime): the
models an algorithm has (PM and/or GM) are reported, finite and above chance; the others are not."""

from __future__ import annotations

import json
import math

import pytest

from hfl.runtime.simulate import run

CHANCE = 1 / 10  # synthetic data: 10 classes
FLAT = "algorithm.team_rounds=1"

# algorithm -> (overrides on top of the small config, has PM, has GM)
BASELINES = {
    "local": ([FLAT], True, False),
    "fedprox": ([FLAT], False, True),
    # beta = 0.001 (pFedMe README) barely moves the global model in three rounds
    "perfedavg": ([FLAT, "algorithm.beta=0.05"], True, True),
    "perfedavg_hf": ([FLAT, "algorithm.beta=0.05"], True, True),
    "pfedme": ([FLAT], True, True),
    "ditto": ([FLAT], True, True),
    # a DNN, so that there is a body to share besides the personal head
    "fedper": ([FLAT, "model=dnn"], True, False),
    "fedrep": ([FLAT, "model=dnn", "algorithm.head_steps=10"], True, False),
    "pfedbayes": ([FLAT], True, True),
    "l2gd": ([FLAT], True, True),
    # K = 2, L = 5 here: a global pull of 0.05*1*12 = 0.6 so that the global mean learns too
    "al2gd": (["algorithm.lam_global=1.0"], True, True),
    "demlearn": ([], True, True),
}


@pytest.mark.parametrize("algorithm", sorted(BASELINES))
def test_baseline_runs_and_learns(algorithm, small_cfg, tmp_path):
    overrides, has_pm, has_gm = BASELINES[algorithm]
    summary = run(small_cfg(f"algorithm={algorithm}", "runtime=inprocess", *overrides), tmp_path)
    assert summary["algorithm"] == algorithm and summary["rounds"] == 3
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3]
    for target, present in (("pm", has_pm), ("gm", has_gm)):
        final = summary["final"][f"{target}_accuracy"]
        if not present:
            assert final is None and all(line.get(f"{target}_accuracy") is None for line in lines)
            continue
        assert final > CHANCE
        for line in lines:
            assert math.isfinite(line[f"{target}_loss"]) and 0 <= line[f"{target}_accuracy"] <= 1
