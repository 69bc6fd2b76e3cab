"""A deployed node's children behind the Grid (hfl.deploy.grid, hfl.deploy.children),
on an in-memory Grid that answers with real NumPyClients through Flower's own legacy handler."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from flwr.client import NumPyClient
from flwr.client.message_handler.message_handler import handle_legacy_message_from_msgtype
from flwr.common import FitIns, GetPropertiesIns, ndarrays_to_parameters, parameters_to_ndarrays

from hfl.deploy import grid as grid_module
from hfl.deploy.children import AbsentChild, Children, ChildrenManager
from hfl.deploy.grid import ChildFailed, GridProxy, evaluate_together, fit_together
from hfl.node.inprocess import client_manager_of


@pytest.fixture(autouse=True)
def task_identity():  # noqa: ANN201
    """What flwr-serverapp sets before it runs a ServerApp (messages are stamped with it)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield


class Doubler(NumPyClient):
    def __init__(self, name: dict, fail: bool = False) -> None:
        self.name = name
        self.fail = fail

    def get_properties(self, config):  # noqa: ANN001, ANN201
        return dict(self.name)

    def fit(self, parameters, config):  # noqa: ANN001, ANN201
        if self.fail:
            raise RuntimeError("out of memory")
        return [2 * p for p in parameters], 3, {"round": config["round"], **self.name}

    def evaluate(self, parameters, config):  # noqa: ANN001, ANN201
        return 0.5, 4, {"correct": 2, **self.name}


class MemoryGrid:
    """Pushes keep messages; a pull answers those whose node is up (a node that is down never
    answers). Counts pulls, to see that replies are collected together."""

    def __init__(self, clients: dict[int, NumPyClient]) -> None:
        self.clients = clients
        self.down: set[int] = set()
        self.dead: set[int] = set()  # answered by the SuperLink: "node unavailable" (missed heartbeats)
        self.pushed: list[int] = []  # destination of every message pushed
        self.pending: dict[str, object] = {}
        self.ids = itertools.count()
        self.pulls = 0
        self.crash: dict[int, int] = {}  # node -> how many of its next tasks die ("ClientApp stopped responding")

    def get_node_ids(self):  # noqa: ANN201
        return list(self.clients)

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        out = []
        for msg in messages:
            msg_id = f"m{next(self.ids)}"
            msg.metadata.__dict__["_message_id"] = msg_id
            self.pending[msg_id] = msg
            self.pushed.append(msg.metadata.dst_node_id)
            out.append(msg_id)
        return out

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        self.pulls += 1
        replies = []
        for msg_id in message_ids:
            msg = self.pending.get(msg_id)
            node = msg.metadata.dst_node_id
            if node in self.dead:
                from flwr.app import Error, Message
                from flwr.common.constant import ErrorCode

                replies.append(Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Node Unavailable"), reply_to=msg))
                del self.pending[msg_id]
                continue
            if node in self.down:
                continue
            if self.crash.get(node):
                from flwr.app import Error, Message
                from flwr.common.constant import ErrorCode

                self.crash[node] -= 1
                replies.append(Message(Error(code=ErrorCode.CLIENT_APP_CRASHED, reason="ClientApp stopped responding."),
                                       reply_to=msg))
                del self.pending[msg_id]
                continue
            client = self.clients[node]
            try:
                reply = handle_legacy_message_from_msgtype(lambda _ctx, c=client: c.to_client(), msg, None)
            except Exception as exc:  # noqa: BLE001 - Flower's ClientApp turns it into an error reply
                from flwr.app import Error, Message

                reply = Message(Error(code=0, reason=repr(exc)), reply_to=msg)
            replies.append(reply)
            del self.pending[msg_id]
        return replies


def test_fit_together_equals_the_clients_and_counts_the_dead_and_the_failing() -> None:
    grid = MemoryGrid({11: Doubler({"device_id": 1}), 12: Doubler({"device_id": 2}, fail=True),
                       13: Doubler({"device_id": 3})})
    grid.down.add(13)
    proxies = [GridProxy(f"{d:06d}", n, grid, timeout=0.2, interval=0.01) for d, n in ((1, 11), (2, 12), (3, 13))]
    ins = FitIns(ndarrays_to_parameters([np.ones(3, dtype=np.float32)]), {"round": "1.1"})
    ok, failed, dead = fit_together([(p, ins) for p in proxies] )
    assert np.array_equal(parameters_to_ndarrays(ok.parameters)[0], 2 * np.ones(3)) and ok.num_examples == 3
    assert ok.metrics == {"round": "1.1", "device_id": 1}
    assert isinstance(failed, ChildFailed) and "out of memory" in str(failed)
    assert isinstance(dead, ChildFailed) and "no reply within 0.2 s" in str(dead)
    absent = fit_together([(AbsentChild("000004"), ins)])
    assert isinstance(absent[0], ChildFailed) and "000004 is not connected" in str(absent[0])


def test_evaluate_together_leaves_out_children_that_did_not_answer() -> None:
    grid = MemoryGrid({11: Doubler({"device_id": 1}), 12: Doubler({"device_id": 2})})
    grid.down.add(12)
    proxies = [GridProxy(f"{d:06d}", n, grid, timeout=0.2, interval=0.01) for d, n in ((1, 11), (2, 12))]
    params = ndarrays_to_parameters([np.ones(2, dtype=np.float32)])
    replies, sent = evaluate_together(client_manager_of(proxies), params, {"model": "global"})
    assert [(cid, r.num_examples, r.metrics["correct"]) for cid, r in replies] == [("000001", 4, 2)]
    assert sent == 2 * sum(len(t) for t in params.tensors)


def test_children_are_named_by_the_tree_and_a_restarted_child_replaces_its_old_node() -> None:
    grid = MemoryGrid({21: Doubler({"path": "0.0"}), 22: Doubler({"path": "7.7"})})
    children = Children(grid, ["0.0", "0.1"], devices=False, wait_seconds=0.3, timeout=1.0, interval=0.01)
    proxies = children.proxies()  # 0.1 never comes: absent after the wait; 7.7 is not ours
    assert [(p.cid, type(p).__name__) for p in proxies] == [("0.0", "GridProxy"), ("0.1", "AbsentChild")]
    assert proxies[0].node_id == 21 and children.names[22] is None
    del grid.clients[21]  # 0.0's SuperNode dies and comes back as a new Flower node
    grid.clients[23] = Doubler({"path": "0.0"})
    grid.clients[24] = Doubler({"path": "0.1"})
    proxies = children.proxies()
    assert [(p.cid, p.node_id) for p in proxies] == [("0.0", 23), ("0.1", 24)]


def test_the_roots_manager_names_level1_nodes_by_path_and_fails_the_absent() -> None:
    grid = MemoryGrid({5: Doubler({"path": "1"}), 6: Doubler({"path": "0"})})
    manager = ChildrenManager(Children(grid, ["0", "1", "2"], devices=False, wait_seconds=0.2, timeout=1.0))
    assert manager.wait_for(3) and manager.num_available() == 3
    proxies = manager.all()
    assert {cid: getattr(p, "node_id", None) for cid, p in proxies.items()} == {"0": 6, "1": 5, "2": None}
    assert proxies["1"].get_properties(GetPropertiesIns({}), timeout=1.0, group_id=None).properties == {"path": "1"}
    with pytest.raises(ChildFailed, match="2 is not connected"):
        proxies["2"].get_properties(GetPropertiesIns({}), timeout=1.0, group_id=None)


@pytest.fixture
def quick_looks(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setattr(grid_module, "RELOCATE_EVERY", 0.05)


def test_a_message_to_a_child_started_again_is_sent_to_its_new_node(quick_looks) -> None:  # noqa: ANN001
    """Device 1's SuperNode (node 11) dies mid-round without a word and comes back as node 31:
    the fit waiting on 11 is pushed again to 31 and answered there; device 2 is answered once."""
    grid = MemoryGrid({11: Doubler({"device_id": 1}), 12: Doubler({"device_id": 2})})
    children = Children(grid, ["000001", "000002"], devices=True, wait_seconds=0.2, timeout=5.0, interval=0.01)
    proxies = children.proxies()
    grid.down.add(11)
    grid.clients[31] = Doubler({"device_id": 1})
    ins = FitIns(ndarrays_to_parameters([np.ones(2, dtype=np.float32)]), {"round": "2.1"})
    first, second = fit_together([(p, ins) for p in proxies])
    assert first.metrics == {"round": "2.1", "device_id": 1} and second.metrics["device_id"] == 2
    assert grid.pushed[-4:] == [11, 12, 31, 31]  # the round's two messages, 31 asked who it is, 11's fit again
    assert children.nodes == {"000001": 31, "000002": 12}


def test_a_child_flower_reports_gone_fails_after_the_rejoin_wait_or_is_resent_when_back(quick_looks) -> None:  # noqa: ANN001
    grid = MemoryGrid({11: Doubler({"path": "0.0"})})
    children = Children(grid, ["0.0"], devices=False, wait_seconds=0.2, timeout=None, interval=0.01,
                        rejoin_seconds=0.3)
    (proxy,) = children.proxies()
    grid.dead.add(11)
    ins = FitIns(ndarrays_to_parameters([np.ones(2, dtype=np.float32)]), {"round": "1"})
    (failed,) = fit_together([(proxy, ins)])  # no timeout, yet it ends: Flower said the node is gone
    assert isinstance(failed, ChildFailed) and "Node Unavailable" in str(failed)
    grid.clients[12] = Doubler({"path": "0.0"})  # back, before the rejoin wait ends
    (ok,) = fit_together([(proxy, ins)])
    assert ok.metrics == {"round": "1", "path": "0.0"} and grid.pushed[-1] == 12


def test_a_node_server_counts_the_looks_its_superlink_did_not_answer() -> None:
    from hfl.deploy.node_server import _superlink_lost

    class Gone:
        def get_node_ids(self):  # noqa: ANN201
            raise ConnectionRefusedError("[Errno 111] Connection refused")

    assert _superlink_lost(Gone(), 2) == 3  # the third in a row ends the node server
    assert _superlink_lost(MemoryGrid({}), 2) == 0


@pytest.mark.parametrize(("crashes", "answered"), [(1, True), (2, True), (3, False)])
def test_a_child_whose_task_process_died_is_sent_its_message_again(crashes, answered) -> None:
    """A device's runner (or Flower's ClientApp process) killed mid-task: its SuperNode answers
    "ClientApp stopped responding"; the node sends the message again, twice at most (CRASH_RETRIES)."""
    grid = MemoryGrid({11: Doubler({"device_id": 1}), 12: Doubler({"device_id": 2})})
    children = Children(grid, ["000001", "000002"], devices=True, wait_seconds=0.2, timeout=5.0, interval=0.01)
    proxies = children.proxies()
    grid.crash[11] = crashes
    ins = FitIns(ndarrays_to_parameters([np.ones(2, dtype=np.float32)]), {"round": "3.1"})
    first, second = fit_together([(p, ins) for p in proxies])
    assert second.metrics["device_id"] == 2 and grid.pushed.count(12) == 2  # asked who it is, its fit once
    if answered:
        assert first.metrics == {"round": "3.1", "device_id": 1}
        assert grid.pushed.count(11) == 2 + crashes  # asked who it is, the fit, the fit again per crash
    else:
        assert isinstance(first, ChildFailed) and "ClientApp stopped responding" in str(first)
        assert grid.pushed.count(11) == 2 + 2


def test_a_child_flower_declared_gone_that_comes_back_as_the_same_node_is_sent_its_message_again(
        quick_looks) -> None:  # noqa: ANN001
    """A long cut: Flower answers "node unavailable" (missed heartbeats) and drops the node from
    its list; the SuperNode reconnects under its old id. The message is pushed to it again and
    answered, and later rounds reach it too (it is not taken for absent)."""

    class Offline(MemoryGrid):
        def get_node_ids(self):  # noqa: ANN201 - Flower lists online nodes only
            return [n for n in self.clients if n not in self.dead]

    grid = Offline({11: Doubler({"path": "0.0"})})
    children = Children(grid, ["0.0"], devices=False, wait_seconds=0.2, timeout=None, interval=0.01,
                        rejoin_seconds=30.0)
    (proxy,) = children.proxies()
    grid.dead.add(11)
    ins = FitIns(ndarrays_to_parameters([np.ones(2, dtype=np.float32)]), {"round": "1"})
    import threading

    threading.Timer(0.3, grid.dead.discard, args=(11,)).start()  # back after 0.3 s, same node id
    (ok,) = fit_together([(proxy, ins)])
    assert ok.metrics == {"round": "1", "path": "0.0"} and grid.pushed.count(11) >= 2
    (again,) = children.proxies()
    assert isinstance(again, GridProxy) and again.node_id == 11
