"""benchmarks/scale.py's sizes section: which rounds an --eval-every run evaluates, and the
medians it reports for the plain and the evaluated rounds (round 1, the start-up, left out)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_scale():
    sys.path.insert(0, str(BENCHMARKS))  # its `from peak_memory import PeakMemory`
    try:
        spec = importlib.util.spec_from_file_location("scale_benchmark", BENCHMARKS / "scale.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_evaluated_rounds_follow_hfl_schedule():
    scale = load_scale()
    assert scale.evaluated_rounds(5, None) == [5]  # the default: the last round only
    assert scale.evaluated_rounds(11, 2) == [2, 4, 6, 8, 10, 11]
    assert scale.evaluated_rounds(9, 3) == [3, 6, 9]


def test_round_medians_split_plain_and_evaluated_rounds():
    scale = load_scale()
    # round 1 (start-up) 20 s; plain rounds 3, 5 at 1 s and 3 s; evaluated 2, 4, 6 at 2, 9, 4 s
    seconds = [20.0, 2.0, 1.0, 9.0, 3.0, 4.0]
    assert scale.round_medians(seconds, scale.evaluated_rounds(6, 2)) == (2.0, 4.0)
    # the default schedule: plain rounds 2..5, the last evaluated
    assert scale.round_medians(seconds, [6]) == (2.5, 4.0)
