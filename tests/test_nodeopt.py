"""Node optimisers against hand-computed values (not a re-implementation of the update rules)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hfl.errors import ConfigError
from hfl.rules.nodeopt import DEFAULTS, OPTIMIZERS, apply, check_spec, init_state

# Throughout: params [1, 2], target [3, 0], so delta = target - params = [2, -2].
P = [np.array([1.0, 2.0])]
T = [np.array([3.0, 0.0])]


def spec(optimizer: str, **fields: object) -> dict:
    return check_spec("node.opt", {"optimizer": optimizer, **fields})


def step(s: dict, params: list, target: list, state: dict | None = None) -> tuple[list, dict]:
    return apply(s, params, target, init_state(params) if state is None else state)


def towards(params: list, d: float) -> list:
    """A target whose delta from ``params`` is [d, -d]: keeps step-2 arithmetic by hand simple."""
    return [params[0] + np.array([d, -d])]


def close(actual: np.ndarray, expected: list[float]) -> None:
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)


def test_replace_copies_target() -> None:
    new, state = step(spec("replace"), P, T)
    close(new[0], [3.0, 0.0])
    assert new[0] is not T[0]  # a copy: the node may later mutate its model
    assert set(state) == {"step"}


def test_sgd_lr1_is_replace_and_lr_half_is_halfway() -> None:
    close(step(spec("sgd"), P, T)[0][0], [3.0, 0.0])
    # 1 + .5*2 = 2, 2 + .5*(-2) = 1
    close(step(spec("sgd", lr=0.5), P, T)[0][0], [2.0, 1.0])


def test_sgd_momentum_two_steps() -> None:
    s = spec("sgd", lr=0.1, momentum=0.9)
    # step 1: m = [2, -2]; params = [1.2, 1.8]
    p1, st = step(s, P, T)
    close(p1[0], [1.2, 1.8])
    close(st["m_0"], [2.0, -2.0])
    # step 2, same target: delta = [1.8, -1.8]; m = .9*2 + 1.8 = 3.6; params = 1.2 + .36, 1.8 - .36
    p2, st = step(s, p1, T, st)
    close(st["m_0"], [3.6, -3.6])
    close(p2[0], [1.56, 1.44])


def test_adam_two_steps_without_bias_correction() -> None:
    s = spec("adam", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    # step 1: m = .1*2 = .2; v = .01*4 = .04; sqrt v = .2; update = .1*.2/(.2+.001) = .02/.201 = .0995024876
    p1, st = step(s, P, T)
    close(st["m_0"], [0.2, -0.2])
    close(st["v_0"], [0.04, 0.04])
    close(p1[0], [1.0995024875621890, 1.9004975124378110])
    # step 2, delta [1, -1]: m = .18 + .1 = .28; v = .0396 + .01 = .0496; sqrt v = .2227105745
    # update = .1*.28/(.2227105745+.001) = .028/.2237105745 = .1251617187
    p2, st = step(s, p1, towards(p1, 1.0), st)
    close(st["m_0"], [0.28, -0.28])
    close(st["v_0"], [0.0496, 0.0496])
    close(p2[0] - p1[0], [0.1251617187114584, -0.1251617187114584])


def test_adam_two_steps_with_bias_correction() -> None:
    # beta2 .999 so even step 1 differs (with .99, sqrt(1-.99)/(1-.9) = 1 and step 1 is unchanged)
    s = spec("adam", lr=0.1, beta1=0.9, beta2=0.999, tau=1e-3, bias_correction=True)
    # step 1: eta = .1*sqrt(.001)/.1 = .0316227766; m = .2; v = .001*4 = .004; sqrt v = .0632455532
    # update = .0316227766*.2/(.0632455532+.001) = .0063245553/.0642455532 = .0984434720
    p1, st = step(s, P, T)
    close(st["v_0"], [0.004, 0.004])
    close(p1[0], [1.0984434720379253, 1.9015565279620747])
    # step 2, delta [1, -1]: eta = .1*sqrt(1-.998001)/(1-.81) = .1*.0447101778/.19 = .0235316725
    # m = .28; v = .999*.004 + .001 = .004996; sqrt v = .0706823882
    # update = .0235316725*.28/(.0706823882+.001) = .0065888683/.0716823882 = .0919175334
    p2, st = step(s, p1, towards(p1, 1.0), st)
    close(st["v_0"], [0.004996, 0.004996])
    close(p2[0] - p1[0], [0.09191753338158323, -0.09191753338158323])


def test_yogi_sign_flip() -> None:
    s = spec("yogi", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    # step 1: v - delta^2 = 0 - 4 < 0, so v grows: v = 0 + .01*4 = .04 (same as adam)
    p1, st = step(s, P, T)
    close(st["v_0"], [0.04, 0.04])
    close(p1[0], [1.0995024875621890, 1.9004975124378110])
    # step 2, delta [.1, -.1]: delta^2 = .01, v - delta^2 = .03 > 0, so v shrinks: v = .04 - .01*.01 = .0399
    # (adam would give .99*.04 + .01*.01 = .0397). m = .18 + .01 = .19; sqrt v = .1997498436
    # update = .1*.19/(.1997498436+.001) = .019/.2007498436 = .0946451547
    p2, st = step(s, p1, towards(p1, 0.1), st)
    close(st["v_0"], [0.0399, 0.0399])
    close(st["m_0"], [0.19, -0.19])
    np.testing.assert_allclose(p2[0] - p1[0], [0.09464515470395887, -0.09464515470395887], rtol=1e-9)


def test_adagrad_accumulates() -> None:
    s = spec("adagrad", lr=0.1, beta1=0.0, tau=1e-3)
    # step 1: m = delta = 2; v = 4; update = .1*2/(2+.001) = .0999500250
    p1, st = step(s, P, T)
    close(st["v_0"], [4.0, 4.0])
    close(p1[0], [1.0999500249875063, 1.9000499750124937])
    # step 2, delta [1, -1]: v = 4 + 1 = 5 (summed, never decayed); update = .1/(2.2360679775+.001) = .0447013685
    p2, st = step(s, p1, towards(p1, 1.0), st)
    close(st["v_0"], [5.0, 5.0])
    np.testing.assert_allclose(p2[0] - p1[0], [0.0447013684902695, -0.0447013684902695], rtol=1e-9)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_step_counter_and_no_mutation(optimizer: str) -> None:
    s = spec(optimizer, lr=0.5, momentum=0.5)
    params, target = [a.copy() for a in P], [a.copy() for a in T]
    state = init_state(params)
    assert state["step"].shape == () and int(state["step"]) == 0
    _, state1 = apply(s, params, target, state)
    saved = {k: v.copy() for k, v in state1.items()}
    _, state2 = apply(s, params, target, state1)
    assert int(state1["step"]) == 1 and int(state2["step"]) == 2
    assert state2["step"].dtype == np.int64
    assert int(state["step"]) == 0
    for k, v in saved.items():
        np.testing.assert_array_equal(state1[k], v)
    np.testing.assert_array_equal(params[0], P[0])
    np.testing.assert_array_equal(target[0], T[0])


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_float32_preserved(optimizer: str) -> None:
    params = [np.array([1.0, 2.0], dtype=np.float32), np.ones((2, 3), dtype=np.float32)]
    target = [np.array([3.0, 0.0], dtype=np.float32), np.zeros((2, 3), dtype=np.float32)]
    s = spec(optimizer, lr=0.1, momentum=0.9, bias_correction=True)
    new, state = apply(s, params, target, init_state(params))
    new, state = apply(s, new, target, state)
    assert [a.dtype for a in new] == [np.float32, np.float32]
    assert [a.shape for a in new] == [(2,), (2, 3)]
    assert all(v.dtype == np.float32 for k, v in state.items() if k != "step")


def test_mismatched_shapes_raise() -> None:
    s = spec("adam")
    with pytest.raises(ValueError):
        apply(s, [np.zeros(2)], [np.zeros(3)], init_state([np.zeros(2)]))
    with pytest.raises(ValueError):
        apply(s, [np.zeros(2)], [np.zeros(2), np.zeros(2)], init_state([np.zeros(2)]))


@pytest.mark.parametrize(
    ("fields", "bad_key"),
    [
        ({"optimizer": "adamw"}, "node.opt.optimizer"),
        ({"lr": 0.01}, "node.opt.optimizer"),  # optimiser missing
        ({"optimizer": "sgd", "lr": -1}, "node.opt.lr"),
        ({"optimizer": "sgd", "lr": math.nan}, "node.opt.lr"),
        ({"optimizer": "sgd", "lr": math.inf}, "node.opt.lr"),
        ({"optimizer": "sgd", "momentum": 1.0}, "node.opt.momentum"),
        ({"optimizer": "adam", "beta1": 1.0}, "node.opt.beta1"),
        ({"optimizer": "adam", "beta2": -0.1}, "node.opt.beta2"),
        ({"optimizer": "adam", "tau": 0}, "node.opt.tau"),
        ({"optimizer": "adam", "bias_correction": "yes"}, "node.opt.bias_correction"),
        ({"optimizer": "adam", "weight_decay": 0.1}, "node.opt.weight_decay"),
    ],
)
def test_check_spec_names_bad_key(fields: dict, bad_key: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_spec("node.opt", fields)
    assert info.value.key == bad_key
    assert str(info.value).startswith(bad_key)


def test_check_spec_unknown_optimiser_lists_known() -> None:
    with pytest.raises(ConfigError, match="unknown optimiser 'adamw'; known: replace, sgd, adam, yogi, adagrad"):
        check_spec("k", {"optimizer": "adamw"})


def test_check_spec_merges_defaults() -> None:
    assert check_spec("k", {"optimizer": "adam", "lr": 0.01}) == {**DEFAULTS, "optimizer": "adam", "lr": 0.01}
    assert DEFAULTS == {"lr": 1.0, "momentum": 0.0, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3, "bias_correction": False}
