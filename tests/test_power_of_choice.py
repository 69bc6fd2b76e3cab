"""Loss-aware choice of children (power-of-choice, Cho et al. 2020, with the losses the children
last reported: rpow-d): ``algorithm.candidates`` per level, written once in the round's cohort
(hfl.node.cohort) and working at the root and at inner nodes, in process and on Ray (the
deployment's case is in tests/test_deployment.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from hfl.errors import ConfigError
from hfl.node.cohort import LOSSES, Cohort, Selection, reported_loss
from hfl.node.inprocess import NamedChild, RoundsReport
from hfl.runtime.simulate import run
from hfl.state.store import StateStore
from hfl.tree.sampling import sample_children
from tests.conftest import compose_cfg

CHILDREN = [NamedChild(str(i)) for i in range(6)]


def reply(**metrics: float) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.zeros(1)]), 10, dict(metrics))


def cohort_with(losses: dict[str, float], candidates: float = 5 / 6, fraction: float = 0.5) -> Cohort:
    stored = {LOSSES: np.frombuffer(json.dumps(losses).encode(), dtype=np.uint8)} if losses else None
    return Cohort(Selection(fraction, 0.0, 7, candidates), "0", stored=stored)


# ---------------------------------------------------------------- the choice, by hand
def test_a_round_asks_the_candidates_with_the_highest_last_loss_in_tree_order():
    losses = {"0": 0.5, "1": 2.0, "2": 1.0, "3": 3.0, "4": 0.1, "5": 0.7}
    cohort = cohort_with(losses)
    pool = sample_children(CHILDREN, 5 / 6, 7, "0", "4.2")  # 5 of the 6, drawn as sampling draws
    assert len(pool) == 5
    highest = sorted((c.cid for c in pool), key=lambda cid: -losses[cid])[:3]  # ceil(0.5 x 6) asked
    asked = cohort.ask("4.2", CHILDREN)
    assert [c.cid for c in asked] == sorted(highest)
    (row,) = cohort.rows
    assert row == {"node": "0", "round": "4.2", "candidates": [c.cid for c in pool],
                   "losses": [losses[c.cid] for c in pool], "asked": sorted(highest)}


def test_every_child_a_candidate_is_the_greedy_choice_and_one_never_heard_from_goes_first():
    cohort = cohort_with({"0": 0.5, "1": 2.0, "2": 1.0, "3": 3.0, "5": 0.7}, candidates=1.0)
    assert [c.cid for c in cohort.ask("1.1", CHILDREN)] == ["1", "3", "4"]  # 4 unknown, then 3.0 and 2.0
    assert cohort.rows[0]["losses"] == [0.5, 2.0, 1.0, 3.0, None, 0.7]


def test_before_any_loss_is_known_the_choice_is_a_seeded_draw_of_the_candidates():
    first = [c.cid for c in cohort_with({}).ask("1.1", CHILDREN)]
    again = [c.cid for c in cohort_with({}).ask("1.1", CHILDREN)]
    other = {tuple(c.cid for c in cohort_with({}).ask(f"{r}.1", CHILDREN)) for r in range(2, 12)}
    assert first == again and len(first) == 3
    assert len(other) > 1  # not always the lowest cids


# ---------------------------------------------------------------- what it learns and keeps
def test_reported_loss_of_a_device_and_of_a_node():
    assert reported_loss({"train_loss": 0.25}) == 0.25
    assert reported_loss({"train_loss_sum": 6.0, "train_loss_examples": 4}) == 1.5
    assert reported_loss({"train_loss_examples": 0}) is None
    assert reported_loss({}) is None
    assert reported_loss({"train_loss": math.nan}) is None


def test_observed_losses_survive_the_call_through_the_stored_state():
    cohort = cohort_with({"0": 9.0})
    cohort.observe("1.1", [(CHILDREN[0], reply(train_loss=0.5)), (CHILDREN[1], reply(train_loss_sum=3.0,
                                                                                       train_loss_examples=2)),
                           (CHILDREN[2], reply(train_loss=math.inf)), (CHILDREN[3], reply(correct=1))])
    assert cohort.losses == {"0": 0.5, "1": 1.5}
    assert Cohort(cohort.selection, "0", stored=cohort.state()).losses == {"0": 0.5, "1": 1.5}
    assert Cohort(Selection(0.5), "0").state() == {}  # no loss-aware choice: nothing stored


def test_a_node_reply_carries_its_subtrees_training_loss():
    report = RoundsReport()
    report.add_child_counters({"train_loss": 2.0}, 3)  # a device
    report.add_child_counters({"train_loss": 1.0}, 1)
    report.add_child_counters({"train_loss_sum": 4.0, "train_loss_examples": 4}, 4)  # a child node
    assert report.subtree["train_loss_sum"] == 11.0 and report.subtree["train_loss_examples"] == 8
    assert reported_loss(report.subtree) == 11.0 / 8


# ---------------------------------------------------------------- the config
BASE = ["algorithm=fedavg", "topology=tree", "dataset.max_samples=200", "dataset.batch_size=32",
        "algorithm.local_steps=3", "runtime.torch_threads=1", "runtime=inprocess"]


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["topology.fanout=[2,4]", "algorithm.sample_fraction=[1,0.5]", "algorithm.candidates=[0.5,0]"],
     "algorithm.candidates[0]", "asks every child"),
    (["topology.fanout=[2,4]", "algorithm.sample_fraction=[1,0.5]", "algorithm.candidates=[0,0.25]"],
     "algorithm.candidates[1]", "below its algorithm.sample_fraction"),
    (["topology.fanout=[2,4]", "algorithm.sample_fraction=[1,0.5]", "algorithm.candidates=[0,1,1]"],
     "algorithm.candidates", "has 3 entries"),
    (["topology.fanout=[2,4]", "algorithm.sample_fraction=0.5", "algorithm.candidates=1.5"],
     "algorithm.candidates", "1.5"),
    (["topology.fanout=[2,4]", "algorithm.sampling=devices", "algorithm.sample_fraction=0.5",
      "algorithm.candidates=1"], "algorithm.candidates", "sampling=children"),
    (["topology.fanout=[2,4]", "algorithm.sample_fraction=[1,0.5]", "algorithm.candidates=[0,1]", "clock.enabled=true"],
     "algorithm.candidates[1]", "clock"),
])
def test_bad_candidates_stop_the_run_naming_the_key(tmp_path, overrides, key, words):
    with pytest.raises(ConfigError) as err:
        run(compose_cfg(*BASE, *overrides), tmp_path)
    assert err.value.key == key and words in str(err.value)


# ---------------------------------------------------------------- end to end, at the root and at level 1
def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def assert_loss_aware(records: list[dict], node: str) -> list[dict]:
    """Each round of ``node`` asked candidates whose recorded loss is no lower than any candidate's
    it left out (a child not heard from counting as the highest), and knew the loss of exactly the
    candidates it had asked in an earlier round. Its rows."""
    mine = [r for r in records if r["node"] == node]
    heard: set[str] = set()
    for row in mine:
        losses = dict(zip(row["candidates"], row["losses"], strict=True))
        assert {cid for cid, loss in losses.items() if loss is not None} == heard & set(losses)
        key = {cid: math.inf if loss is None else loss for cid, loss in losses.items()}
        assert set(row["asked"]) <= set(losses)
        assert min(key[c] for c in row["asked"]) >= max((key[c] for c in losses if c not in row["asked"]),
                                                          default=-math.inf)
        heard |= set(row["asked"])
    return mine


def test_at_the_root_and_at_level_one_in_process(tmp_path):
    """Root: 2 of 4 level-1 nodes from all 4 candidates; each level-1 node: 2 of its 4 devices from 3
    candidates. The losses they chose by are kept in the stored state and recorded."""
    run_dir = tmp_path / "run"
    run(compose_cfg(*BASE, "topology.fanout=[4,4]", "global_rounds=4", "eval_every=2",
                    "algorithm.sample_fraction=[0.5,0.5]", "algorithm.candidates=[1,0.75]"), run_dir)
    records = rows(run_dir)
    root = assert_loss_aware(records, "root")
    assert len(root) == 4 and all(len(r["candidates"]) == 4 and len(r["asked"]) == 2 for r in root)
    assert root[0]["losses"] == [None] * 4  # nothing heard yet
    assert sum(loss is not None for loss in root[-1]["losses"]) >= 2
    store = StateStore(run_dir / "state")
    kept = json.loads(bytes(store.load("node-root")[LOSSES]).decode())
    assert set(kept) == {cid for r in root for cid in r["asked"]}
    for node in ("0", "1", "2", "3"):
        calls = assert_loss_aware(records, node)
        assert all(len(r["candidates"]) == 3 and len(r["asked"]) == 2 for r in calls)
    assert sum(len(assert_loss_aware(records, node)) for node in "0123") == 4 * 2 * int(
        compose_cfg(*BASE)["algorithm"]["team_rounds"])  # 2 level-1 nodes a global round, K rounds each
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failures"] == 0


def test_the_choice_changes_what_trains_and_a_random_draw_is_kept_without_it(tmp_path):
    common = [*BASE, "topology.fanout=[4,4]", "global_rounds=3", "eval_every=3", "algorithm.sample_fraction=[0.5,0.5]"]
    run(compose_cfg(*common), tmp_path / "random")
    run(compose_cfg(*common, "algorithm.candidates=[1,1]"), tmp_path / "choice")
    random_rows, choice_rows = rows(tmp_path / "random"), rows(tmp_path / "choice")
    assert all("candidates" not in r for r in random_rows)
    assert [r["asked"] for r in random_rows] != [r["asked"] for r in choice_rows]


def test_on_ray_equals_in_process(tmp_path):
    """The root's level-1 nodes are Ray actors: the same children chosen, the same losses, the same models."""
    overrides = ["algorithm=fedavg", "topology=tree", "dataset.max_samples=200", "dataset.batch_size=32",
                 "algorithm.local_steps=3", "runtime.torch_threads=1", "topology.fanout=[4,3]", "global_rounds=3",
                 "eval_every=3", "algorithm.sample_fraction=[0.5,0.67]", "algorithm.candidates=[0.75,1]"]
    run(compose_cfg(*overrides, "runtime=inprocess"), tmp_path / "inprocess")
    run(compose_cfg(*overrides, "runtime=simulation"), tmp_path / "ray")
    local, ray = rows(tmp_path / "inprocess"), rows(tmp_path / "ray")
    assert ray == local and any(r["node"] == "root" for r in local) and any(r["node"] == "2" for r in local)
    with np.load(tmp_path / "inprocess" / "checkpoints" / "global_model.npz") as a, \
            np.load(tmp_path / "ray" / "checkpoints" / "global_model.npz") as b:
        for name in a.files:
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6)
