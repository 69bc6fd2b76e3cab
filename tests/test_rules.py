"""Update rules and shared algorithm pieces against hand-computed values."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hfl.rules.steps import sgd_step
from clients.permfl import device_step
from hfl.rules import aggregate
from hfl.rules.aggregate import all_finite, mean_of, update_problem
from hfl.models import CNN, DNN, MCLR, build_model, mclr_loss_and_grad
from hfl.device.training import BatchSampler, LocalTrainer
from hfl.node.evaluation import pool_evaluations
from strategies.permfl import global_update, team_update


def test_device_step_by_hand():
    # theta=2, grad=1, w=1, alpha=0.1, lam=0.5: 2 - 0.1*1 - 0.1*0.5*(2-1) = 1.85
    out = device_step([np.array([2.0, -1.0])], [np.array([1.0, 0.0])], [np.array([1.0, 1.0])], 0.1, 0.5)
    np.testing.assert_allclose(out[0], [1.85, -1.0 - 0.05 * -2.0])


def test_device_step_with_zero_lambda_is_sgd():
    theta, grad, anchor = [np.array([3.0])], [np.array([2.0])], [np.array([100.0])]
    np.testing.assert_allclose(device_step(theta, grad, anchor, 0.25, 0.0)[0], sgd_step(theta, grad, 0.25)[0])
    np.testing.assert_allclose(sgd_step(theta, grad, 0.25)[0], [2.5])


def test_team_update_by_hand():
    # eta=0.1, lam=2, gamma=3: keep = 1 - 0.2 - 0.3 = 0.5; w = 0.5*4 + 0.3*10 + 0.2*(-5) = 4
    out = team_update([np.array([4.0])], [np.array([10.0])], [np.array([-5.0])], eta=0.1, lam=2.0, gamma=3.0)
    np.testing.assert_allclose(out[0], [4.0])


def test_global_update_by_hand():
    # beta=0.5, gamma=1.5: x = 0.25*8 + 0.75*4 = 5
    np.testing.assert_allclose(global_update([np.array([8.0])], [np.array([4.0])], 0.5, 1.5)[0], [5.0])


def test_global_update_is_identity_when_w_bar_equals_x():
    x = [np.array([1.0, 2.0]), np.array([[3.0]])]
    for a, b in zip(global_update(x, x, 0.6, 1.5), x):
        np.testing.assert_allclose(a, b)


def test_means_uniform_and_weighted():
    models = [[np.array([0.0, 2.0])], [np.array([4.0, 6.0])]]
    np.testing.assert_allclose(mean_of(models)[0], [2.0, 4.0])
    np.testing.assert_allclose(mean_of(models, [3, 1])[0], [1.0, 3.0])
    with pytest.raises(ValueError):
        mean_of([])


def test_update_problem_names_the_defect():
    ref = [np.zeros((2, 3)), np.zeros(3)]
    assert update_problem([np.ones((2, 3)), np.ones(3)], ref) is None
    assert "shape" in update_problem([np.ones((3, 2)), np.ones(3)], ref)
    assert "expected 2" in update_problem([np.ones((2, 3))], ref)
    assert "NaN" in update_problem([np.full((2, 3), np.nan), np.ones(3)], ref)
    assert "NaN" in update_problem([np.ones((2, 3)), np.array([0, np.inf, 0])], ref)
    assert update_problem([np.full((2, 3), np.nan), np.ones(3)], ref, known_finite=True) is None


@pytest.mark.parametrize("where", ["small", "large"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_finds_a_single_bad_value_among_many_updates(monkeypatch, where, bad):
    monkeypatch.setattr(aggregate, "FINITE_CHECK_TOGETHER", 100)  # arrays over 100 values: one by one
    updates = [[np.ones((5, 20), dtype=np.float32), np.zeros(5, dtype=np.float32), np.arange(3)] for _ in range(4)]
    assert all_finite(updates) and all_finite([]) and all_finite([[]])
    updates[2][0 if where == "small" else 1] = np.ones(101 if where == "large" else (5, 20), dtype=np.float32)
    updates[2][0 if where == "small" else 1].flat[-1] = bad
    assert not all_finite(updates)


def test_mclr_closed_form_gradient_matches_autograd():
    torch.manual_seed(0)
    model = MCLR((1, 4, 5), 3)
    trainer = LocalTrainer(model)
    x, y = torch.randn(7, 1, 4, 5), torch.tensor([0, 2, 1, 1, 0, 2, 2])
    params = trainer.initial_params()
    loss_fast, grads_fast = mclr_loss_and_grad(params, x, y)
    trainer.fast_gradient = None  # force autograd
    loss_auto, grads_auto = trainer.loss_and_grad(params, x, y)
    assert torch.allclose(loss_fast, loss_auto, atol=1e-6)
    for a, b in zip(grads_fast, grads_auto):
        assert torch.allclose(a, b, atol=1e-6)


def test_model_output_shapes():
    assert MCLR((60,), 10)(torch.randn(2, 60)).shape == (2, 10)
    assert DNN((60,), 10)(torch.randn(2, 60)).shape == (2, 10)
    cnn = CNN((1, 28, 28), 10)
    assert cnn.fc1.in_features == 18432  # PerMFL's MNIST CNN
    assert cnn(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert build_model({"name": "cnn", "hidden": 8}, (3, 32, 32), 10)(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_sampler_cycles_epochs_and_restores():
    sampler = BatchSampler(5, 2, seed=3)
    batches = [sampler.next() for _ in range(3)]
    assert [len(b) for b in batches] == [2, 2, 1]  # the last batch of an epoch is short
    assert sorted(torch.cat(batches).tolist()) == [0, 1, 2, 3, 4]  # one epoch, no repeats
    state = sampler.state()
    expected = [sampler.next().tolist() for _ in range(4)]
    clone = BatchSampler(5, 2, seed=999)
    clone.restore(state)
    assert [clone.next().tolist() for _ in range(4)] == expected


def test_pool_evaluations_is_sum_correct_over_sum_samples():
    team_a = {"pm_correct": 9, "pm_n": 10, "pm_loss_sum": 1.0, "pm_devices": json.dumps([[0, 4, 5], [1, 5, 5]])}
    team_b = {"pm_correct": 1, "pm_n": 30, "pm_loss_sum": 7.0, "pm_devices": json.dumps([[2, 1, 30]])}
    pooled = pool_evaluations([team_a, team_b])
    assert pooled["pm_accuracy"] == pytest.approx(10 / 40)  # not the mean of team accuracies (0.4625)
    assert pooled["pm_loss"] == pytest.approx(8.0 / 40)
    assert pooled["pm_accuracy_min"] == pytest.approx(1 / 30)
    assert pooled["pm_accuracy_median"] == pytest.approx(0.8)
    assert pooled["pm_accuracy_max"] == pytest.approx(1.0)
    assert pooled["gm_accuracy"] is None  # no team reported GM


def test_rules_refuse_models_with_a_missing_tensor():
    two, one = [np.ones(2), np.ones(3)], [np.ones(2)]
    with pytest.raises(ValueError):
        device_step(two, one, two, 0.1, 0.5)
    with pytest.raises(ValueError):
        team_update(two, two, one, 0.1, 0.5, 1.5)
    with pytest.raises(ValueError):
        global_update(two, one, 0.6, 1.5)
    with pytest.raises(ValueError):
        mean_of([two, two], [1.0])  # a weight per model
