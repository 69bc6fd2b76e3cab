"""runtime.batch_siblings: the root's children fit taking turns, their batched steps merged
(hfl.node.lockstep, hfl.node.inprocess.LockstepServer, hfl.accel.batched.run_plan_requests)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import hfl.accel.batched as batched_module
from hfl.node.lockstep import Lockstep, current_submit
from tests.conftest import SMALL, compose_cfg
from tests.test_batched import _rows, assert_same_run


class Recorder:
    """An ``execute`` that records each batch and answers request r with ``r.upper()``; a request
    ``"bad"`` fails the whole batch it is in."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def __call__(self, requests: list[str]) -> list[str]:
        self.batches.append(list(requests))
        if "bad" in requests:
            raise ValueError("bad request")
        return [r.upper() for r in requests]


def _party(name: str, count: int, trace: list[str], got: list[str]):  # noqa: ANN202
    def task() -> str:
        for k in range(count):
            trace.append(name)
            got.append(current_submit()(f"{name}{k}"))
        trace.append(name)
        return f"{name} done"

    return task


def test_parties_take_turns_in_order_and_each_gets_its_own_results():
    execute, trace, got = Recorder(), [], []
    lockstep = Lockstep(execute)
    out = lockstep.run([_party(n, 2, trace, got) for n in "abc"])
    assert out == ["a done", "b done", "c done"]
    assert execute.batches == [["a0", "b0", "c0"], ["a1", "b1", "c1"]]
    assert trace == list("abc" * 3)  # segment by segment, always in party order
    assert got == ["A0", "B0", "C0", "A1", "B1", "C1"]
    assert lockstep.batches == [3, 3]
    assert current_submit() is None  # outside a party


def test_a_party_with_fewer_steps_drops_out_and_the_rest_go_on_merged():
    execute, trace, got = Recorder(), [], []
    out = Lockstep(execute).run([_party("a", 1, trace, got), _party("b", 3, trace, got), _party("c", 2, trace, got)])
    assert out == ["a done", "b done", "c done"]
    assert execute.batches == [["a0", "b0", "c0"], ["b1", "c1"], ["b2"]]


def test_a_failing_party_returns_its_exception_and_does_not_stop_the_others():
    def failing() -> str:
        current_submit()("x0")
        raise RuntimeError("dead child")

    execute, trace, got = Recorder(), [], []
    out = Lockstep(execute).run([failing, _party("b", 2, trace, got)])
    assert isinstance(out[0], RuntimeError) and out[1] == "b done"
    assert execute.batches == [["x0", "b0"], ["b1"]]


def test_a_failed_merged_batch_is_retried_request_by_request():
    def asking(request: str):  # noqa: ANN202
        def task() -> str:
            return current_submit()(request)
        return task

    execute = Recorder()
    out = Lockstep(execute).run([asking("ok"), asking("bad"), asking("fine")])
    assert out[0] == "OK" and out[2] == "FINE"
    assert isinstance(out[1], ValueError)
    assert execute.batches == [["ok", "bad", "fine"], ["ok"], ["bad"], ["fine"]]


def test_only_one_party_runs_at_a_time():
    running, overlaps = [0], []
    guard = threading.Lock()

    def task() -> None:
        for k in range(3):
            with guard:
                running[0] += 1
                overlaps.append(running[0])
            time.sleep(0.002)  # a thread switch here would let another party in
            with guard:
                running[0] -= 1
            current_submit()(k)

    out = Lockstep(lambda requests: list(requests)).run([task] * 4)
    assert out == [None] * 4
    assert max(overlaps) == 1 and len(overlaps) == 12


def test_no_parties_and_no_submissions():
    assert Lockstep(Recorder()).run([]) == []
    execute = Recorder()
    assert Lockstep(execute).run([lambda: 1, lambda: 2]) == [1, 2]
    assert execute.batches == []


# ---------------------------------------------------------------- whole runs
CASES = {
    "permfl": [],
    "pfedme": [],  # inner steps and a moving anchor
    "pfedbayes": [],  # a group plan of its own: runs apart (hfl.accel.batched.mergeable), the same either way
    "hierfavg-dropout": ["algorithm=hierfavg", "topology.num_teams=3", "runtime.dropout_nodes=0.34",
                         "runtime.dropout=0.34", "algorithm.min_fit_fraction=0.6"],
    "bhfl-tree": ["algorithm=bhfl", "topology=tree", "topology.fanout=[2,2,3]", "algorithm.sample_fraction=[1,0.5,0.67]"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_siblings_equal_one_node_at_a_time(tmp_path, monkeypatch, case):
    from hfl.runtime.simulate import run

    merged: list[int] = []  # nodes per merged call: proof the siblings' steps were merged

    def counted(requests):  # noqa: ANN001, ANN202
        merged.append(len(requests))
        return run_plan_requests(requests)

    run_plan_requests = batched_module.run_plan_requests
    monkeypatch.setattr(batched_module, "run_plan_requests", counted)
    algorithm = [] if "=" in "".join(CASES[case]) and "algorithm=" in "".join(CASES[case]) else [f"algorithm={case}"]
    base = [*SMALL, "runtime=inprocess", "runtime.batched=on", "dataset.batch_size=20", *algorithm, *CASES[case]]
    run(compose_cfg(*base, "runtime.batch_siblings=false"), tmp_path / "apart")
    assert not merged
    run(compose_cfg(*base, "runtime.batch_siblings=true"), tmp_path / "merged")
    if case == "pfedbayes":
        assert not merged
    else:
        assert merged and max(merged) >= 2
    assert_same_run(tmp_path / "merged", tmp_path / "apart")
    assert len(_rows(tmp_path / "merged")) == 3


# ---------------------------------------------------------------- which nodes merge
def _request(sizes: list[int], dim: int = 6):  # noqa: ANN202
    from hfl.accel.batched import PlanRequest
    from tests.test_batched import _device

    return PlanRequest([_device(i, n, 4, dim=dim) for i, n in enumerate(sizes)], [], torch.device("cpu"))


def test_nodes_merge_by_architecture_within_the_caps(monkeypatch):
    from hfl.accel.batched import merged_groups

    requests = [_request([5, 5]), _request([5, 5], dim=7), _request([5, 5]), _request([5, 5, 5])]
    assert merged_groups(requests) == [[0, 2, 3], [1]]  # another input size: another model
    monkeypatch.setattr(batched_module, "MERGE_MAX_DEVICES", 4)
    assert merged_groups(requests) == [[0, 2], [3], [1]]
    monkeypatch.setattr(batched_module, "MERGE_MAX_DEVICES", 2)
    assert merged_groups(requests) == [[0], [2], [3], [1]]  # a node over the cap runs alone
    monkeypatch.setattr(batched_module, "MERGE_MAX_DEVICES", 256)
    one = sum(d.x_train.nbytes + d.y_train.nbytes for d in requests[0].devices)
    monkeypatch.setattr(batched_module, "MERGE_MAX_BYTES", 2 * one)
    assert merged_groups(requests) == [[0, 2], [3], [1]]


def test_a_deep_tree_merges_by_its_lowest_nodes_not_its_subtrees(tmp_path, monkeypatch):
    """fanout [2,2,3]: the root's children hold 6 devices each, its lowest nodes 3. With at most 5
    devices a merge, the lowest nodes still merge (a cap on the subtrees would have stopped them)."""
    from hfl.runtime.simulate import run

    merged: list[int] = []
    run_plan_requests = batched_module.run_plan_requests
    monkeypatch.setattr(batched_module, "run_plan_requests", lambda requests: merged.append(len(requests))
                        or run_plan_requests(requests))
    monkeypatch.setattr(batched_module, "MERGE_MAX_DEVICES", 5)
    run(compose_cfg(*SMALL, "runtime=inprocess", "runtime.batched=on", "dataset.batch_size=20", *CASES["bhfl-tree"]),
        tmp_path / "run")
    assert merged and max(merged) >= 2
