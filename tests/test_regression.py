"""Every algorithm computes the models it computed before the tree engine (recorded by
``tests/regression/record.py`` on the small config, seed 0): global, level-1 (team) and
personal models within 1e-6 (Per-FedAvg HF: 1e-5, see ``TOLERANCE``)."""

from __future__ import annotations

import numpy as np
import pytest

from hfl.simulate import run
from tests.conftest import compose_cfg
from tests.regression.record import CASES, OUT, final_models, overrides


def recorded(algorithm: str) -> dict[str, list[np.ndarray]]:
    out: dict[str, dict[int, np.ndarray]] = {}
    with np.load(OUT) as data:
        for key in data.files:
            alg, name, i = key.split("/")
            if alg == algorithm:
                out.setdefault(name, {})[int(i)] = data[key]
    return {name: [arrays[i] for i in sorted(arrays)] for name, arrays in out.items()}


# Per-FedAvg HF's finite-difference Hessian-vector product divides a gradient difference by
# 2 * delta = 0.002: float rounding of the (now batched) gradients grows 500x there.
TOLERANCE = {"perfedavg_hf": 1e-5}


@pytest.mark.parametrize("algorithm", list(CASES))
def test_models_unchanged(algorithm, tmp_path):
    expected = recorded(algorithm)
    assert expected, f"no recorded models for {algorithm}"
    run(compose_cfg(*overrides(algorithm)), tmp_path)
    got = final_models(tmp_path)
    assert sorted(got) == sorted(expected)
    for name, arrays in expected.items():
        assert len(got[name]) == len(arrays), name
        for a, b in zip(got[name], arrays, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE.get(algorithm, 1e-6), err_msg=f"{algorithm} {name}")
