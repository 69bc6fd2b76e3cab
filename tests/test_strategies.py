"""Node and root strategies over algorithms' server rules, through Flower's own message types."""

from __future__ import annotations

import numpy as np

from hfl.node.round_counters import RoundCounters
import pytest
from flwr.common import (
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_proxy import ClientProxy

from strategies.fedavg import FedAvgServer
from strategies.permfl import PerMFLServer
from tests.conftest import node_strategy, root_strategy

ALG = {"alpha": 0.1, "local_steps": 1, "lam": 2.0, "eta": 0.1, "gamma": 3.0, "beta": 0.5, "weighted": False}


class Proxy(ClientProxy):
    def get_properties(self, *a): ...
    def get_parameters(self, *a): ...
    def fit(self, *a): ...
    def evaluate(self, *a): ...
    def reconnect(self, *a): ...


def reply(value, n: int, **metrics) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.array([value], dtype=np.float32)]), n, metrics)


def test_team_strategy_applies_the_permfl_rule_in_device_order():
    parent = [np.array([10.0], dtype=np.float32)]
    team = node_strategy(PerMFLServer, parent, ALG)
    team.configure_fit(1, ndarrays_to_parameters([np.array([4.0], dtype=np.float32)]), client_manager=_manager())
    # theta_bar = (-7 + -3) / 2 = -5 (uniform); w = 0.5*4 + 0.3*10 + 0.2*(-5) = 4
    results = [(Proxy("b"), reply(-3.0, 90, device_id=1)), (Proxy("a"), reply(-7.0, 10, device_id=0))]
    params, stats = team.aggregate_fit(1, results, [])
    np.testing.assert_allclose(parameters_to_ndarrays(params)[0], [4.0], rtol=1e-6)
    assert stats["aggregated"] == 2 and stats["rejected"] == 0


def test_team_strategy_rejects_nan_and_wrong_shapes_and_counts_them():
    team = node_strategy(PerMFLServer, [np.array([10.0], dtype=np.float32)], {**ALG, "min_fit_fraction": 0.25})
    team.configure_fit(1, ndarrays_to_parameters([np.array([4.0], dtype=np.float32)]), client_manager=_manager())
    bad_shape = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.zeros(3, dtype=np.float32)]), 5, {"device_id": 2})
    results = [(Proxy("a"), reply(-5.0, 10, device_id=0)), (Proxy("b"), reply(np.nan, 10, device_id=1)),
               (Proxy("c"), bad_shape)]
    params, stats = team.aggregate_fit(1, results, [RuntimeError("dead device")])
    assert stats == {"rejected": 2, "failures": 1, "aggregated": 1}
    # only the good update counts: theta_bar = -5 -> w = 4
    np.testing.assert_allclose(parameters_to_ndarrays(params)[0], [4.0], rtol=1e-6)


def test_team_round_below_min_fraction_aggregates_nothing():
    team = node_strategy(PerMFLServer, [np.array([1.0], dtype=np.float32)], {**ALG, "min_fit_fraction": 0.75})
    team.configure_fit(1, ndarrays_to_parameters([np.array([1.0], dtype=np.float32)]), client_manager=_manager())
    results = [(Proxy("a"), reply(1.0, 1, device_id=0)), (Proxy("b"), reply(np.inf, 1, device_id=1))]
    params, stats = team.aggregate_fit(1, results, [RuntimeError("x")])
    assert params is None and stats["aggregated"] == 1


def test_global_strategy_fails_loudly_without_team_models(tmp_path):
    strategy = root_strategy(PerMFLServer, [np.zeros(1, dtype=np.float32)], ALG, tmp_path, num_children=2, num_rounds=3)
    strategy.counts = RoundCounters()
    params, stats = strategy.aggregate_fit(1, [(Proxy("a"), reply(np.nan, 5, level1_index=0))], [RuntimeError("died")])
    # as every node's round: nothing aggregated, and the loop stops the run naming the root (tests/test_faults.py)
    assert params is None and stats == {"rejected": 1, "failures": 1, "aggregated": 0, "needed": 1}


def _replies(models, weights):  # noqa: ANN001, ANN202
    from hfl.algorithm import Replies, Update

    return Replies(1, "1", [Update(m, w, {}, {"model": m}) for m, w in zip(models, weights, strict=True)])


def test_global_permfl_and_fedavg_rules(tmp_path):
    x = [np.array([8.0], dtype=np.float32)]
    replies = _replies([[np.array([2.0])], [np.array([6.0])]], [1, 3])
    permfl = root_strategy(PerMFLServer, x, {**ALG, "beta": 0.5, "gamma": 1.5}, tmp_path, num_children=2, num_rounds=1)
    # w_bar uniform = (2 + 6)/2 = 4; x = 0.25*8 + 0.75*4 = 5
    np.testing.assert_allclose(permfl.rule.aggregate(x, replies)[0], [5.0])
    fedavg = root_strategy(FedAvgServer, x, {"weighted": True}, tmp_path, num_children=2, num_rounds=1)
    np.testing.assert_allclose(fedavg.rule.aggregate(x, replies)[0], [5.0])


def test_the_root_keeps_its_model_and_rule_state_in_the_store_and_is_rebuilt_from_it(tmp_path):
    """The root is a node: after a round its model is in the store under node-root, versioned by
    the round; a root built on that store (a resumed run) starts from it, not from its initial model."""
    from hfl.node.cohort import Cohort, Selection
    from hfl.state.store import StateStore

    x = [np.array([8.0], dtype=np.float32)]
    root = root_strategy(PerMFLServer, x, {**ALG, "beta": 0.5, "gamma": 1.5}, tmp_path, num_children=2, num_rounds=3)
    root.counts = RoundCounters()
    root.store.round = 1
    results = [(Proxy("a"), reply(2.0, 1, level1_index=0)), (Proxy("b"), reply(6.0, 3, level1_index=1))]
    root.aggregate_fit(1, results, [])
    root._save(Cohort(Selection(), ""))  # what fit_round does once its round loop is done
    np.testing.assert_allclose(StateStore(tmp_path).load("node-root")["w_0"], [5.0])
    again = root_strategy(PerMFLServer, x, {**ALG, "beta": 0.5, "gamma": 1.5}, tmp_path, num_children=2, num_rounds=3)
    np.testing.assert_allclose(again.current[0], [5.0])
    StateStore(tmp_path).rollback(0)  # back before round 1: the initial model again
    fresh = root_strategy(PerMFLServer, x, {**ALG, "beta": 0.5, "gamma": 1.5}, tmp_path, num_children=2, num_rounds=3)
    np.testing.assert_allclose(fresh.current[0], [8.0])


def _manager():
    from flwr.server.client_manager import SimpleClientManager

    return SimpleClientManager()


def test_weighted_means_use_sample_counts():
    team = node_strategy(PerMFLServer, [np.array([10.0], dtype=np.float32)], {**ALG, "weighted": True})
    team.configure_fit(1, ndarrays_to_parameters([np.array([4.0], dtype=np.float32)]), client_manager=_manager())
    # theta_bar = (10*-7 + 30*-3)/40 = -4; w = 0.5*4 + 0.3*10 + 0.2*(-4) = 4.2
    results = [(Proxy("a"), reply(-7.0, 10, device_id=0)), (Proxy("b"), reply(-3.0, 30, device_id=1))]
    params, _ = team.aggregate_fit(1, results, [])
    np.testing.assert_allclose(parameters_to_ndarrays(params)[0], [4.2], rtol=1e-6)


def test_devices_get_lambda_or_the_authors_slip():
    fixed = node_strategy(PerMFLServer, [np.zeros(1)], {**ALG, "local_steps": 20, "lam": 0.5})
    slip = node_strategy(PerMFLServer, [np.zeros(1)], {**ALG, "local_steps": 20, "lam": 0.5, "prox_slip": True})
    assert fixed.fit_config["prox_coefficient"] == 0.5
    assert slip.fit_config["prox_coefficient"] == 20  # L where lambda belongs, as in the authors' code


def test_global_strategy_refuses_a_node_count_that_differs_from_the_topology(tmp_path):
    from flwr.server.client_manager import SimpleClientManager

    manager = SimpleClientManager()
    for cid in ("0", "1", "2"):
        manager.register(Proxy(cid))
    strategy = root_strategy(PerMFLServer, [np.zeros(1)], ALG, tmp_path, num_children=2, num_rounds=1, wait_seconds=0.1)
    with pytest.raises(RuntimeError, match="3 level-1 nodes connected but topology has 2"):
        strategy.fit_round(1, manager, lambda calls: [])


def test_global_strategy_refuses_two_nodes_serving_one_team(tmp_path):
    strategy = root_strategy(PerMFLServer, [np.zeros(1, dtype=np.float32)], ALG, tmp_path, num_children=2, num_rounds=1)
    strategy.counts = RoundCounters()
    results = [(Proxy("a"), reply(1.0, 5, level1_index=0)), (Proxy("b"), reply(2.0, 5, level1_index=0))]
    with pytest.raises(RuntimeError, match=r"root round 1: two replies from the same child \(level1_index \[0\]\)"):
        strategy.aggregate_fit(1, results, [])


def test_global_evaluation_pools_the_teams_that_answered_and_counts_the_others(tmp_path):
    import json
    import time

    from flwr.common import EvaluateRes

    strategy = root_strategy(PerMFLServer, [np.zeros(1, dtype=np.float32)], ALG, tmp_path, num_children=2, num_rounds=1)
    strategy.counts = RoundCounters()
    report = {"level1_index": 1, "gm_correct": 3, "gm_n": 4, "gm_loss_sum": 2.0, "gm_devices": json.dumps([[7, 3, 4]])}
    loss, metrics = strategy.aggregate_evaluate(
        1, [(Proxy("a"), EvaluateRes(Status(Code.OK, ""), 0.5, 4, report))], [RuntimeError("team 0 run failed")]
    )
    assert metrics["gm_accuracy"] == 0.75 and loss == 0.5
    assert strategy.counts["failures"] == 1 and strategy.counts["evaluation_failures"] == 1
    strategy.counts = RoundCounters()
    with pytest.raises(RuntimeError, match="evaluation failed on all 2 level-1 node"):
        strategy.aggregate_evaluate(1, [], [RuntimeError("x"), RuntimeError("y")])
