"""Every algorithm computes what it computed before the engine changes that followed the tree
engine (recorded by ``tests/regression/record.py`` on the small config, seed 0): the root's
model, every stored node and device state, and every number of metrics.jsonl, within 1e-6
(Per-FedAvg HF: 1e-5, see ``TOLERANCE``)."""

from __future__ import annotations

import numpy as np
import pytest

from hfl.runtime.simulate import run
from tests.conftest import compose_cfg
from tests.regression.record import CASES, OUT, overrides, results


def recorded(case: str) -> dict[str, np.ndarray]:
    with np.load(OUT) as data:
        return {key.split("/", 1)[1]: data[key] for key in data.files if key.split("/", 1)[0] == case}


# Per-FedAvg HF's finite-difference Hessian-vector product divides a gradient difference by
# 2 * delta = 0.002: float rounding of the (now batched) gradients grows 500x there.
TOLERANCE = {"perfedavg_hf": 1e-5}
# What a run may store beyond the recording: the root's own state, once it lives in the store.
MAY_ADD = ("state/node-root/",)


@pytest.mark.parametrize("case", list(CASES))
def test_results_unchanged(case, tmp_path):
    expected = recorded(case)
    assert expected, f"no recorded results for {case}"
    run(compose_cfg(*overrides(case)), tmp_path)
    got = results(tmp_path)
    assert sorted(set(expected) - set(got)) == [], "results no longer produced"
    assert sorted(k for k in set(got) - set(expected) if not k.startswith(MAY_ADD)) == [], "results not recorded"
    tolerance = TOLERANCE.get(case, 1e-6)
    for name, want in expected.items():
        have = got[name]
        assert have.shape == want.shape and have.dtype.kind == want.dtype.kind, name
        if want.dtype.kind in "fc":
            np.testing.assert_allclose(have, want, rtol=0, atol=tolerance, equal_nan=True, err_msg=f"{case} {name}")
        else:
            np.testing.assert_array_equal(have, want, err_msg=f"{case} {name}")
