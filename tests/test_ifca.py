"""IFCA (strategies.ifca, clients.ifca): the per-cluster rule by hand, its composition up a
tree, the device's choice, whole runs flat and on a depth-3 tree, resume, and its config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hydra import compose, initialize_config_dir

from clients.ifca import IfcaClient, best_cluster
from hfl.algorithm import Replies, Update
from hfl.config import schema
from hfl.config.checks import validate
from hfl.config.compose import CONF_DIR
from hfl.errors import ConfigError
from hfl.rules.payload import Payload, pack
from hfl.runtime.simulate import run
from strategies.ifca import IfcaServer, cluster_means, entries
from tests.conftest import SMALL, compose_cfg, rule_context
from tests.test_resume import assert_resumed_equals_whole

ALG = {"num_clusters": 3, "weighted": True, "alpha": 0.1, "local_steps": 1}


def m(value: float) -> list[np.ndarray]:
    return [np.array([value], dtype=np.float32)]


def device(value: float, n: int, cluster: int, device_id: int = 0) -> Update:
    return Update(m(value), n, {"device_id": device_id, "cluster": cluster}, {"model": m(value)})


def node_rule(path: str = "0", clusters=(0.0, 10.0, 20.0), alg=ALG) -> IfcaServer:  # noqa: ANN001
    parts = {"model": m(clusters[0]), **{f"c{k}": m(v) for k, v in enumerate(clusters) if k}}
    ctx = rule_context(IfcaServer, alg, path, 2, Payload("parts", parts))
    return IfcaServer(ctx)


def node_reply(rule: IfcaServer, n: int) -> Update:
    """What NodeClient sends up after the rule's call: its model (cluster 0) with its parts."""
    parts = {"model": rule.clusters[0], **rule.reply_parts()}
    return Update(rule.clusters[0], n, {"node": rule.ctx.path}, parts)


# ---------------------------------------------------------------- the rule
def test_a_node_takes_each_clusters_weighted_mean_and_keeps_an_unpicked_one():
    rule = node_rule()
    replies = Replies(1, "1.1", [device(2.0, 10, 0), device(4.0, 30, 0), device(7.0, 5, 2)])
    model = rule.aggregate(m(0.0), replies)
    np.testing.assert_allclose(model[0], [3.5])  # (2*10 + 4*30) / 40
    np.testing.assert_allclose(rule.clusters[1][0], [10.0])  # nobody picked cluster 1
    np.testing.assert_allclose(rule.clusters[2][0], [7.0])
    np.testing.assert_array_equal(rule.counts, [40.0, 0.0, 5.0])
    parts = rule.reply_parts()
    np.testing.assert_array_equal(parts["counts"][0], [40.0, 0.0, 5.0])
    assert set(parts) == {"c1", "c2", "counts"}


def test_unweighted_means_count_devices():
    rule = node_rule(alg={**ALG, "weighted": False})
    rule.aggregate(m(0.0), Replies(1, "1", [device(2.0, 10, 1), device(4.0, 30, 1)]))
    np.testing.assert_allclose(rule.clusters[1][0], [3.0])
    np.testing.assert_array_equal(rule.counts, [0.0, 2.0, 0.0])


def test_two_levels_compose_into_the_flat_per_cluster_means():
    devices = [[device(1.0, 3, 0), device(5.0, 7, 1)], [device(2.0, 11, 1), device(9.0, 2, 2), device(4.0, 6, 0)]]
    flat = node_rule()
    flat.aggregate(m(0.0), Replies(1, "1", [d for team in devices for d in team]))
    nodes = []
    for t, team in enumerate(devices):
        rule = node_rule(str(t))
        rule.aggregate(m(0.0), Replies(1, "1.1", team))
        nodes.append(node_reply(rule, sum(d.num_examples for d in team)))
    top = node_rule("9")  # a parent of the two (the rule is the same at every level)
    top.aggregate(m(0.0), Replies(1, "1", nodes))
    for k in range(3):
        np.testing.assert_allclose(top.clusters[k][0], flat.clusters[k][0], rtol=1e-6)
    np.testing.assert_array_equal(top.counts, flat.counts)


def test_a_cluster_index_out_of_range_is_refused_naming_the_device():
    with pytest.raises(ValueError, match="device 4 picked cluster 3"):
        list(entries([device(1.0, 1, 3, device_id=4)], 3, True))


def test_cluster_means_of_nothing_keep_every_model():
    means, counts = cluster_means([], [m(1.0), m(2.0)])
    assert [a[0][0] for a in means] == [1.0, 2.0] and counts.tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- the device
class _Trainer:
    """Loss = squared distance of the model's one weight to the data's mean."""

    def evaluate(self, params, x, y):  # noqa: ANN001, ANN201
        return float(((params[0] - x.mean()) ** 2).sum()) * len(y), 0, len(y)


def test_the_device_picks_the_cluster_with_the_lowest_training_loss():
    x, y = torch.full((4, 1), 6.0), torch.zeros(4, dtype=torch.long)
    clusters = [m(0.0), m(5.0), m(9.0)]
    assert best_cluster(_Trainer(), clusters, x, y) == 1
    assert best_cluster(_Trainer(), [m(5.0), m(5.0)], x, y) == 0  # a tie: the lowest index


def test_a_device_trains_the_cluster_it_picks_and_tests_it_as_its_pm(small_cfg):
    from hfl.device.training import LocalTrainer
    from hfl.models import build_model
    from hfl.runtime.build import device_runtime, federation_for, initial_model

    cfg = small_cfg("algorithm=ifca", "algorithm.local_steps=3", "algorithm.alpha=0.1")
    fed = federation_for(cfg)
    good = [np.zeros_like(a) for a in initial_model(cfg, fed)]  # uniform predictions: loss ln(C)
    rng = np.random.default_rng(0)
    bad = [(50 * rng.standard_normal(a.shape)).astype(a.dtype) for a in good]  # confidently wrong
    client = IfcaClient(device_runtime(cfg, 0, fed.devices[0],
                                       LocalTrainer(build_model(cfg["model"], fed.input_shape, fed.num_classes)), None))
    arrays, meta = pack("parts", {"model": bad, "c1": good})
    model, n, metrics = client.fit(arrays, {**meta, "alpha": 0.1, "local_steps": 3})
    assert metrics["cluster"] == 1 and n == len(fed.devices[0].y_train)
    assert not np.allclose(model[0], good[0])  # trained from the good model, not returned as it was
    assert np.abs(model[0]).max() < 5  # ... and not from the bad one
    # its PM: the cluster it would pick, sent as ctx_ parts
    arrays, meta = pack("parts", {"ctx_c0": bad, "ctx_c1": good})
    tested = client.model_to_test(arrays, {**meta, "model": "personal"})
    np.testing.assert_array_equal(tested[0].numpy(), good[0])


# ---------------------------------------------------------------- whole runs
def rows(run_dir) -> list[dict]:  # noqa: ANN001
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Two clear clusters of devices (multi-level synthetic data: 2 top-level clusters).
CLUSTERED = ["dataset=synthetic_multilevel", "dataset.clusters=[2]", "dataset.scales=[0.0,2.0,0.1]",
             "topology=tree", "model=mclr", "dataset.batch_size=32", "runtime=inprocess", "runtime.torch_threads=1",
             "algorithm.local_steps=5", "algorithm.alpha=0.05", "global_rounds=6"]


@pytest.mark.parametrize("fanout", ["[2,6]", "[2,2,3]"])
def test_ifca_beats_one_global_model_on_two_clusters(fanout, tmp_path):
    ifca = run(compose_cfg(*CLUSTERED, f"topology.fanout={fanout}", "algorithm=ifca"), tmp_path / "ifca")
    fedavg = run(compose_cfg(*CLUSTERED, f"topology.fanout={fanout}", "algorithm=fedavg"), tmp_path / "fedavg")
    last = rows(tmp_path / "ifca")[-1]
    assert last["gm_accuracy"] is None and last["ifca_clusters_used"] == 2.0
    assert ifca["final"]["pm_accuracy"] > fedavg["final"]["gm_accuracy"] + 0.05


def test_flat_and_tree_runs_give_the_same_models(tmp_path):
    """The per-cluster means compose: a depth-3 tree computes the depth-2 tree's models."""
    from hfl.algorithm import model_from_state
    from hfl.state.store import StateStore

    out = {}
    for fanout in ("[1,12]", "[2,2,3]"):
        run(compose_cfg(*CLUSTERED, f"topology.fanout={fanout}", "algorithm=ifca", "global_rounds=3"), tmp_path / fanout)
        out[fanout] = StateStore(tmp_path / fanout / "state").load("node-root")
    flat, tree = out["[1,12]"], out["[2,2,3]"]
    assert sorted(flat) == sorted(tree)
    for key in flat:
        np.testing.assert_allclose(tree[key], flat[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert model_from_state(flat) is not None


def test_a_killed_ifca_run_resumes_to_the_uninterrupted_one(tmp_path, monkeypatch):
    cfg = compose_cfg(*SMALL, "algorithm=ifca", "runtime=inprocess", "global_rounds=4", "eval_every=2")
    assert_resumed_equals_whole(cfg, tmp_path, monkeypatch, "fit", 3)


# ---------------------------------------------------------------- config
def test_config_validates_and_refuses_bad_keys_naming_them():
    validate(compose_cfg("algorithm=ifca"))
    with pytest.raises(ConfigError, match=r"algorithm\.num_clusters"):
        validate(compose_cfg("algorithm=ifca", "algorithm.num_clusters=0"))
    # what IFCA is (no global model, no level models) is its rule's class, not a setting
    assert (IfcaServer.global_model, IfcaServer.level_models, IfcaServer.personalized) == (False, False, True)
    with pytest.raises(ConfigError, match=r"algorithm\.global_model: is the algorithm's nature \(IfcaServer"):
        schema.register()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            schema.check_keys(compose("config", overrides=["algorithm=ifca", "++algorithm.global_model=true"]))
