"""The tree engine end to end and its parts: deeper trees against flat FedAvg and HierFAVG,
node state across calls, per-level sampling, nested evaluation counts, refusals of bad trees,
payloads, and the per-level metrics. Tiny configurations, in-process runtime."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

from hfl.device.state import stored_device_states
from hfl.errors import ConfigError
from hfl.rules.payload import LocalParameters, Payload, pack, payload_nbytes, unpack
from hfl.runtime.build import build_node, federation_for, initial_model
from hfl.tree.sampling import sample_children, sample_size
from hfl.runtime.simulate import run
from hfl.state.store import StateStore
from hfl.node.client import model_from_state, node_key
from hfl.node.strategy import accept_results
from tests.conftest import SMALL, compose_cfg

BASE = [*SMALL, "runtime=inprocess", "global_rounds=2", "algorithm.local_steps=3", "dataset.max_samples=200"]


def cfg_of(*overrides: str) -> dict:
    return compose_cfg(*BASE, *overrides)


def arrays_of(path: Path, prefix: str) -> list[np.ndarray]:
    with np.load(path) as data:
        names = sorted((n for n in data.files if n.startswith(prefix) and n[len(prefix):].isdigit()),
                       key=lambda n: int(n[len(prefix):]))
        return [data[n] for n in names]


def global_model(run_dir: Path) -> list[np.ndarray]:
    return arrays_of(run_dir / "checkpoints" / "global_model.npz", "arr_")


def node_model(run_dir: Path, path: str) -> list[np.ndarray]:
    return arrays_of(run_dir / "state" / f"{node_key(path)}.npz", "w_")


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same(a: list[np.ndarray], b: list[np.ndarray], atol: float = 1e-6) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def differs(a: list[np.ndarray], b: list[np.ndarray], by: float = 1e-4) -> bool:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True)) > by


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run a configuration once per module: (run_dir, summary)."""
    done: dict[tuple, tuple[Path, dict]] = {}

    def get(*overrides: str) -> tuple[Path, dict]:
        if overrides not in done:
            run_dir = tmp_path_factory.mktemp("run")
            done[overrides] = (run_dir, run(cfg_of(*overrides), run_dir))
        return done[overrides]

    return get


BHFL_235 = ("algorithm=bhfl", "algorithm.team_rounds=1", "topology=tree", "topology.fanout=[2,3,5]")
FEDAVG_FLAT = ("algorithm=fedavg", "algorithm.team_rounds=1", "topology=tree", "topology.fanout=[1,30]")
FEDAVG_235 = ("algorithm=fedavg", "algorithm.team_rounds=1", "topology=tree", "topology.fanout=[2,3,5]")


# ---------------------------------------------------------------- 1. depth-3 FedAvg = flat FedAvg
def test_depth3_bhfl_defaults_equal_flat_fedavg_and_tree_fedavg(runs):
    bhfl_dir, _ = runs(*BHFL_235)
    flat_dir, _ = runs(*FEDAVG_FLAT)
    tree_dir, _ = runs(*FEDAVG_235)
    bhfl, flat, tree = global_model(bhfl_dir), global_model(flat_dir), global_model(tree_dir)
    assert_same(bhfl, flat)
    assert_same(bhfl, tree)
    # ...and the model did move: the equality is not that of three untouched initial models
    cfg = cfg_of(*BHFL_235)
    assert differs(bhfl, initial_model(cfg, federation_for(cfg)))
    # the same 30 devices hold the same data whatever the tree's shape
    flat_fed = federation_for(cfg_of(*FEDAVG_FLAT))
    n_flat = [len(d.y_train) for d in flat_fed.devices]
    assert n_flat == [len(d.y_train) for d in federation_for(cfg).devices]
    assert federation_for(cfg).tree.depth == 3 and flat_fed.tree.depth == 2


# ---------------------------------------------------------------- 2. bhfl defaults = HierFAVG
def test_bhfl_defaults_on_three_tiers_equal_hierfavg(runs):
    bhfl_dir, _ = runs("algorithm=bhfl")
    hier_dir, _ = runs("algorithm=hierfavg")
    assert_same(global_model(bhfl_dir), global_model(hier_dir))
    for team in ("0", "1"):
        assert_same(node_model(bhfl_dir, team), node_model(hier_dir, team))
    # the two teams' models are not the same model (the comparison can tell teams apart)
    assert differs(node_model(bhfl_dir, "0"), node_model(bhfl_dir, "1"))


# ---------------------------------------------------------------- 3. node state across calls
NODE_OPT = ("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.up.optimizer=adam",
            "algorithm.up.lr=0.01")


def test_run_keeps_node_models_and_optimiser_states(runs):
    run_dir, _ = runs(*NODE_OPT, "algorithm.down.optimizer=sgd", "algorithm.down.lr=0.5", "global_rounds=1")
    store = StateStore(run_dir / "state")
    root, level1, level2 = store.load("node-root"), store.load("node-0"), store.load("node-0.0")
    # the root's model is the checkpoint; one global round = one adam merge with moments per tensor
    assert_same(model_from_state(root), global_model(run_dir), atol=0)
    assert int(root["up.step"]) == 1 and {"up.m_0", "up.v_0"} <= set(root)
    # level 1 runs 1 round per call on a depth-3 tree; level 2 (lowest) team_rounds = 2 (SMALL)
    assert int(level1["up.step"]) == 1 and int(level2["up.step"]) == 2
    # a node's first call starts from its parent's model: no down merge happened yet
    assert not any(k.startswith("down.") for k in level1) and not any(k.startswith("down.") for k in level2)
    assert model_from_state(level1) is not None and len(model_from_state(level1)) == len(global_model(run_dir))
    # every device trained and kept its model
    assert sum(int(s["num_personal"]) > 0 for s in stored_device_states(StateStore(run_dir / "state")).values()) == 12


def _fit_node(cfg: dict, state_dir: Path, parent: list[np.ndarray]) -> list[np.ndarray]:
    model, n, metrics = build_node(cfg, "0", state_dir).fit(parent, {"global_round": 1})
    assert n > 0 and metrics["node"] == "0"
    return model


def test_node_called_twice_keeps_state_and_grows_steps(tmp_path):
    cfg = cfg_of(*NODE_OPT, "algorithm.down.optimizer=sgd", "algorithm.down.lr=0.5", "algorithm.level_rounds=[2,1]")
    parent = initial_model(cfg, federation_for(cfg))
    store = StateStore(tmp_path)

    first = _fit_node(cfg, tmp_path, parent)
    state1 = store.load("node-0")
    assert {"w_0", "up.step"} <= set(state1) and int(state1["up.step"]) == 2  # level_rounds[0] = 2 rounds
    assert "down.step" not in state1  # nothing was kept: the first call starts from the parent
    assert_same(model_from_state(state1), first, atol=0)

    second = _fit_node(cfg, tmp_path, parent)
    state2 = store.load("node-0")
    assert int(state2["up.step"]) == 4  # grew by the node's 2 rounds
    assert int(state2["down.step"]) == 1  # the kept model was merged with the parent's
    assert differs(model_from_state(state1), model_from_state(state2))
    assert store.load("node-1") is None  # never called
    assert store.load("node-0.0") is not None and store.load("node-0.1") is not None
    assert differs(first, second)


def _fit_with_kept_shifted(cfg: dict, source: Path, target: Path, shift: float) -> list[np.ndarray]:
    """A copy of ``source``'s store whose node-0 model is moved by ``shift``, then one call of node 0."""
    shutil.copytree(source, target)
    store = StateStore(target)
    state = store.load("node-0")
    store.save("node-0", {k: (v + shift if k.startswith("w_") else v) for k, v in state.items()})
    parent = initial_model(cfg, federation_for(cfg))
    return _fit_node(cfg, target, [p + 0.01 for p in parent])


@pytest.mark.parametrize(("down", "depends"), [(("algorithm.down.optimizer=replace",), False),
                                               (("algorithm.down.optimizer=sgd", "algorithm.down.lr=0.5"), True)])
def test_kept_model_matters_only_when_down_is_not_replace(tmp_path, down, depends):
    cfg = cfg_of(*NODE_OPT, *down)
    _fit_node(cfg, tmp_path / "start", initial_model(cfg, federation_for(cfg)))
    same = _fit_with_kept_shifted(cfg, tmp_path / "start", tmp_path / "a", 0.0)
    moved = _fit_with_kept_shifted(cfg, tmp_path / "start", tmp_path / "b", 0.5)
    if depends:
        assert differs(same, moved)
    else:
        assert_same(same, moved, atol=0)


# ---------------------------------------------------------------- 4. sampling
def test_sample_size_rounds_up_with_at_least_one():
    assert sample_size(5, 0.4) == 2  # ceil(0.4 * 5) = 2
    assert sample_size(5, 0.41) == 3  # ceil(2.05) = 3
    assert sample_size(10, 0.3) == 3  # 0.3 * 10 = 3.0000000000000004 in floats; still 3
    assert sample_size(10, 0.01) == 1  # ceil(0.1) = 1
    assert sample_size(3, 1.0) == 3
    for n, fraction in ((0, 0.5), (5, 0.0), (5, 1.5), (5, -0.1)):
        with pytest.raises(ValueError):
            sample_size(n, fraction)


def test_sample_children_is_a_seeded_ordered_subset():
    children = list("abcdefghij")
    picked = sample_children(children, 0.4, 7, "0.1", "3.1.2")
    assert len(picked) == 4 and set(picked) <= set(children) and len(set(picked)) == 4
    assert picked == sorted(picked, key=children.index)  # order kept
    assert picked == sample_children(children, 0.4, 7, "0.1", "3.1.2")  # deterministic
    assert sample_children(children, 1.0, 7, "0.1", "3.1.2") == children
    # it depends on the round, the node and the seed
    rounds = {tuple(sample_children(children, 0.4, 7, "0.1", f"{r}.1.1")) for r in range(1, 21)}
    nodes = {tuple(sample_children(children, 0.4, 7, f"0.{i}", "1.1.1")) for i in range(20)}
    seeds = {tuple(sample_children(children, 0.4, s, "0.1", "1.1.1")) for s in range(20)}
    assert len(rounds) > 1 and len(nodes) > 1 and len(seeds) > 1


SAMPLED = ("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,5]",
           "algorithm.sample_fraction=[1.0,1.0,0.4]")


def _samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_sampled_lowest_level_writes_samples_jsonl(runs):
    run_dir, _ = runs(*SAMPLED)
    cfg = cfg_of(*SAMPLED)
    tree = federation_for(cfg).tree
    records = _samples(run_dir)
    lowest = tree.nodes_at(2)
    team_rounds, global_rounds = cfg["algorithm"]["team_rounds"], cfg["global_rounds"]
    # every lowest node, every one of its rounds in every global round: 4 nodes x 2 x 2
    assert len(records) == len(lowest) * team_rounds * global_rounds == 16
    seen = {(r["global_round"], r["node"], r["round"]) for r in records}
    assert seen == {(g, node, f"{g}.1.{t}") for g in (1, 2) for node in lowest for t in (1, 2)}
    for record in records:
        assert len(record["asked"]) == math.ceil(0.4 * 5) == 2
        assert {int(cid) for cid in record["asked"]} <= set(tree.devices(record["node"]))
    # nothing above the lowest level samples, so nothing else is recorded
    assert {r["node"] for r in records} == set(lowest)
    # GM still evaluated on every device (n adds up over all 20 devices)
    line = metric_lines(run_dir)[-1]
    assert line["gm_accuracy"] is not None and line["level2_accuracy"] is not None


def test_samples_are_reproducible_and_seeded(runs):
    first, _ = runs(*SAMPLED)
    again, _ = runs(*SAMPLED, "seed=0")
    other, _ = runs(*SAMPLED, "seed=1")
    # the same records, in the same (tree) order
    assert (first / "samples.jsonl").read_text() == (again / "samples.jsonl").read_text()

    def asked(run_dir: Path) -> list[list[str]]:
        return [r["asked"] for r in sorted(_samples(run_dir), key=lambda r: (r["global_round"], r["node"], r["round"]))]

    assert asked(first) != asked(other)


def test_samples_are_recorded_in_team_order_whatever_the_arrival_order(tmp_path):
    """The root's round loop calls its level-1 nodes at once (Flower ids in any order, replies
    arriving in any order: node 0 answers last) and records their samples in tree order."""
    import threading

    from flwr.common import GetPropertiesRes
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.client_proxy import ClientProxy

    from hfl.node.inprocess import fit_together
    from strategies.fedavg import FedAvgServer
    from tests.conftest import root_strategy

    x = [np.zeros(2, dtype=np.float32)]
    strategy = root_strategy(FedAvgServer, x, {"weighted": True}, tmp_path, num_children=2, num_rounds=1)
    records = {t: json.dumps([{"node": f"{t}.0", "round": "1.1.1", "asked": [f"00000{t}"]}]) for t in (0, 1)}
    answered_1 = threading.Event()

    class Level1(ClientProxy):
        def __init__(self, cid: str, path: int) -> None:
            super().__init__(cid)
            self.path = path

        def get_properties(self, ins, timeout, group_id):  # noqa: ANN001, ANN201
            return GetPropertiesRes(Status(Code.OK, ""), {"path": str(self.path)})

        def fit(self, ins, timeout, group_id):  # noqa: ANN001, ANN201
            if self.path == 0:
                assert answered_1.wait(10)  # node 1's reply arrives first
            reply = _res([_a(self.path, self.path)], 5, level1_index=self.path, node=str(self.path),
                         samples=records[self.path])
            answered_1.set()
            return reply

        get_parameters = evaluate = reconnect = None

    manager = SimpleClientManager()
    for cid, path in (("9", 0), ("3", 1)):  # Flower's ids sort the other way round
        manager.register(Level1(cid, path))
    strategy.fit_round(1, manager, fit_together(1))
    rows = [record for block in strategy.counts["samples"] for record in json.loads(block)]  # as the recorder writes them
    assert rows == json.loads(records[0]) + json.loads(records[1])


def test_unsampled_devices_still_evaluate_their_pm(runs):
    overrides = ("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,5]",
                 "algorithm.sample_fraction=[1.0,1.0,0.4]")
    run_dir, _ = runs(*overrides)
    assert all(line["pm_accuracy"] is not None for line in metric_lines(run_dir))
    cfg = cfg_of(*overrides)
    fed = federation_for(cfg)
    _, _, metrics = build_node(cfg, "0", run_dir / "state").evaluate(global_model(run_dir), {})
    assert metrics["pm_n"] == sum(len(fed.devices[d].y_test) for d in fed.tree.devices_under("0"))


@pytest.mark.parametrize("fractions", ["[1.0,0.5,1.0]", "[1.0,0.5,0.4]"])
def test_devices_under_a_node_sampled_out_above_evaluate_their_pm(runs, fractions):
    """Level 1 asks one of its two level-2 nodes: in the first evaluated round the other's devices
    have never trained, and test the model their first call would start from (this failed with
    "device 2 has no personalized model yet" while only the lowest level's sampling was considered)."""
    run_dir, _ = runs("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,5]",
                      f"algorithm.sample_fraction={fractions}", "eval_every=1")
    lines = metric_lines(run_dir)
    assert [line["round"] for line in lines] == [1, 2]
    assert all(line["pm_accuracy"] is not None for line in lines)
    asked = [json.loads(row) for row in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {len(row["asked"]) for row in asked if row["node"] in ("0", "1")} == {1}


def test_the_root_samples_its_level1_nodes_as_every_node_samples_its_children(runs):
    """sample_fraction's entry 0: the root asks one of its two level-1 nodes a round (recorded); the
    other's devices are still tested, on the model their first call would start from."""
    run_dir, summary = runs("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]",
                            "algorithm.sample_fraction=[0.5,1.0,1.0]", "eval_every=1")
    root = [json.loads(row) for row in (run_dir / "samples.jsonl").read_text().splitlines()]
    root = [row for row in root if row["node"] == "root"]
    assert [row["round"] for row in root] == ["1", "2"] and all(len(row["asked"]) == 1 for row in root)
    called = {row["asked"][0] for row in root}
    stored = {p.stem for p in (run_dir / "state").glob("node-*.npz")} - {"node-root"}
    assert {key.split("-")[1].split(".")[0] for key in stored} == called  # only asked subtrees trained
    assert all(line["pm_accuracy"] is not None for line in metric_lines(run_dir)) and summary["failures"] == 0


# ---------------------------------------------------------------- 5. nested evaluation counts
def test_nested_evaluation_counts_add_up(tmp_path):
    cfg = cfg_of("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]")
    fed = federation_for(cfg)
    x = initial_model(cfg, fed)
    build_node(cfg, "0", tmp_path).fit(x, {"global_round": 1})
    loss, n, metrics = build_node(cfg, "0", tmp_path).evaluate(x, {})
    test_sizes = sum(len(fed.devices[d].y_test) for d in fed.tree.devices_under("0"))
    assert len(fed.tree.devices_under("0")) == 6
    for target in ("gm", "level1", "level2", "pm"):
        assert metrics[f"{target}_n"] == test_sizes, target
        assert len(json.loads(metrics[f"{target}_devices"])) == 6
    assert n == test_sizes and loss == pytest.approx(metrics["gm_loss_sum"] / test_sizes)

    # node 0's counts are the sums of its two children's, given what node 0 forwards to them
    level1 = model_from_state(StateStore(tmp_path).load("node-0"))
    arrays, meta = pack("parts", {"gm": x, "level1": level1})
    children = [build_node(cfg, child, tmp_path).evaluate(arrays, meta)[2] for child in ("0.0", "0.1")]
    for target in ("gm", "level1", "level2", "pm"):
        assert metrics[f"{target}_correct"] == sum(c[f"{target}_correct"] for c in children), target
        assert metrics[f"{target}_n"] == sum(c[f"{target}_n"] for c in children), target
        assert metrics[f"{target}_loss_sum"] == pytest.approx(sum(c[f"{target}_loss_sum"] for c in children))
    # the level-1 and global models are different models and score differently somewhere
    assert differs(level1, x)


# ---------------------------------------------------------------- 6. bad trees stop before training
BAD = [
    (("algorithm=bhfl", "topology=tree", "topology.fanout=[]"), "topology.fanout"),
    (("algorithm=bhfl", "topology=tree", "topology.fanout=[2,0,3]"), "topology.fanout"),
    (("algorithm=bhfl", "topology=tree", "topology.fanout=null", "topology.nodes=[[[0,1],[1,2]],[[3,4],[5,6]]]"),
     "topology.nodes"),
    (("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.up.optimizer=adamw"),
     "algorithm.up.optimizer"),
    (("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.down.lr=-1"), "algorithm.down.lr"),
    (("algorithm=permfl", "topology=tree", "topology.fanout=[2,2,3]"), "topology.fanout"),
    (("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.level_rounds=[1]"),
     "algorithm.level_rounds"),
    (("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.sample_fraction=0"),
     "algorithm.sample_fraction"),
    (("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.sample_fraction=1.5"),
     "algorithm.sample_fraction"),
    (("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.sample_fraction=[1.0,0.0,1.0]"),
     "algorithm.sample_fraction[1]"),
    (("algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.sample_fraction=[1.0,1.0]"),
     "algorithm.sample_fraction"),
]


@pytest.mark.parametrize(("overrides", "key"), BAD, ids=[" ".join(o[2:]) or o[0] for o, _ in BAD])
def test_bad_trees_stop_before_training_naming_the_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as caught:
        run(cfg_of(*overrides), tmp_path)
    assert caught.value.key == key
    assert str(caught.value).startswith(f"{key}:")
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "state").exists()


def test_duplicate_device_message_names_it(tmp_path):
    with pytest.raises(ConfigError, match="device 1 appears twice"):
        run(cfg_of("algorithm=bhfl", "topology=tree", "topology.fanout=null",
                   "topology.nodes=[[[0,1],[1,2]],[[3,4],[5,6]]]"), tmp_path)


# ---------------------------------------------------------------- 7. payloads
def test_local_parameters_count_and_encode_their_arrays_lazily():
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros(0), np.asfortranarray(np.ones((2, 3))),
              np.array(2.5), np.float32(1.5), np.arange(10)[::3]]
    local = LocalParameters(arrays)
    assert local._tensors is None  # nothing encoded yet
    encoded = ndarrays_to_parameters(arrays)
    assert payload_nbytes(local) == sum(len(t) for t in encoded.tensors)  # counted as Flower sends them
    assert local._tensors is None
    assert local.tensors == encoded.tensors  # encoded when read: Flower's bytes
    assert all(np.array_equal(a, b) for a, b in zip(parameters_to_ndarrays(local), arrays, strict=True))
    with pytest.raises(ValueError):  # the bytes, whenever made, are those of the reply
        local.arrays[0][0, 0] = 7.0


def _a(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_parts_round_trip_keeps_names_arrays_and_order():
    parts = {"model": [_a(1, 2), _a(3)], "res_up0": [_a(4)], "gm": [_a(5, 6, 7), _a(8), _a(9)]}
    arrays, meta = pack("parts", parts)
    assert len(arrays) == 6 and meta["payload"] == "parts"
    assert json.loads(meta["parts"]) == [["model", 2], ["res_up0", 1], ["gm", 3]]
    payload = unpack(arrays, meta)
    assert payload.kind == "parts" and list(payload.parts) == ["model", "res_up0", "gm"]
    for name, original in parts.items():
        assert_same(payload.parts[name], original, atol=0)
    assert_same(payload.main, parts["model"], atol=0)


def test_undeclared_payload_is_a_model_and_empty_is_empty():
    payload = unpack([_a(1), _a(2, 3)], {})
    assert payload.kind == "model" and len(payload.main) == 2
    assert_same(payload.main, [_a(1), _a(2, 3)], atol=0)
    arrays, meta = pack("empty")
    assert arrays == [] and meta == {"payload": "empty"}
    empty = unpack(arrays, meta)
    assert empty.kind == "empty" and empty.parts == {}
    with pytest.raises(KeyError):
        _ = empty.main
    assert pack("delta", [_a(1)])[1] == {"payload": "delta"}


@pytest.mark.parametrize(("arrays", "meta"), [
    ([_a(1)], {"payload": "parts", "parts": json.dumps([["model", 2]])}),  # declares 2, carries 1
    ([_a(1), _a(2)], {"payload": "parts", "parts": json.dumps([["model", 1]])}),  # declares 1, carries 2
    ([_a(1)], {"payload": "empty"}),  # empty with arrays
    ([_a(1)], {"payload": "bogus"}),  # unknown kind
])
def test_malformed_payloads_raise_value_error(arrays, meta):
    with pytest.raises(ValueError):
        unpack(arrays, meta)


def test_pack_refuses_wrong_shapes_of_input():
    for kind, parts in (("empty", [_a(1)]), ("model", {"model": [_a(1)]}), ("parts", [_a(1)]), ("nope", [])):
        with pytest.raises(ValueError):
            pack(kind, parts)


class _Proxy:
    def __init__(self, cid: str) -> None:
        self.cid = cid


def _res(arrays: list[np.ndarray], n: int, **metrics) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)


def test_empty_reply_is_skipped_not_rejected():
    reference = [_a(0, 0)]
    empty_arrays, empty_meta = pack("empty")
    bad_arrays, bad_meta = [_a(1, 1)], {"payload": "parts", "parts": json.dumps([["model", 2]])}
    results = [
        (_Proxy("a"), _res(empty_arrays, 0, node="0.0", **empty_meta)),
        (_Proxy("b"), _res([_a(2, 4)], 7, node="0.1")),
        (_Proxy("c"), _res(bad_arrays, 3, node="0.2", **bad_meta)),
    ]
    accepted, rejected = accept_results(results, reference, "device_id", "test")
    assert rejected == 1  # only the malformed one
    assert len(accepted) == 1 and accepted[0].num_examples == 7
    assert_same(accepted[0].model, [_a(2, 4)], atol=0)
    only_empty, none_rejected = accept_results(results[:1], reference, "device_id", "test")
    assert only_empty == [] and none_rejected == 0


def test_parts_reply_gives_the_model_and_keeps_the_other_parts():
    arrays, meta = pack("parts", {"model": [_a(1, 1)], "res_up0": [_a(5, 5)]})
    accepted, rejected = accept_results([(_Proxy("a"), _res(arrays, 4, node="0", **meta))], [_a(0, 0)], "x", "t")
    assert rejected == 0 and isinstance(accepted[0].parts, dict)
    assert_same(accepted[0].model, [_a(1, 1)], atol=0)
    assert_same(accepted[0].parts["res_up0"], [_a(5, 5)], atol=0)
    assert isinstance(Payload("model", {"model": [_a(1)]}).main, list)


# ---------------------------------------------------------------- 8. metrics per level
def test_depth3_metrics_have_every_level(runs):
    run_dir, summary = runs(*BHFL_235)
    lines = metric_lines(run_dir)
    assert [line["round"] for line in lines] == [1, 2]
    for line in lines:
        for key in ("level1_accuracy", "level2_accuracy", "gm_accuracy", "pm_accuracy"):
            assert line[key] is not None and 0 <= line[key] <= 1, key
        assert line["team_accuracy"] == line["level1_accuracy"]
        assert "level3_accuracy" not in line  # devices are level 3 and have no server model
        for level in (0, 1, 2):
            assert line[f"bytes_down_level{level}"] > 0 and line[f"bytes_up_level{level}"] > 0, level
        assert line["bytes_down_global"] == line["bytes_down_level0"]
        assert line["bytes_up_global"] == line["bytes_up_level0"]
        assert line["bytes_down_team"] == line["bytes_down_level1"] + line["bytes_down_level2"]
        assert line["bytes_up_team"] == line["bytes_up_level1"] + line["bytes_up_level2"]
        # below the root more edges carry models than at the root: 2 < 6 < 30 children
        assert line["bytes_up_level0"] < line["bytes_up_level1"] < line["bytes_up_level2"]
    assert summary["final"]["level2_accuracy"] == lines[-1]["level2_accuracy"]
    assert summary["final"]["level1_accuracy"] == lines[-1]["level1_accuracy"]
