"""Asynchronous nodes in real time (hfl.clock.realtime), with real processes: the root's SuperLink,
a host per level-1 node, a SuperNode per device, as in test_deployment. Behind the ``deployment``
marker."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from test_deployment import BASE, _wait_until, deployed, kill_node_server_and_finish

from hfl.deploy.loopback import Deployment
from hfl.state.store import StateStore

pytestmark = pytest.mark.deployment

# The root's, in seconds of wall time. Node 1's link is cut for about as long: under Flower's 30 s
# heartbeat interval, since a SuperNode declared gone (2 intervals missed) does not come back.
DEADLINE = 25.0


def requests(dep: Deployment, path: str, action: str) -> set[int]:
    """The global rounds whose ``action`` (fit, evaluate) node ``path``'s node server was asked."""
    out = set()
    for work in (dep.root / f"node-{path}-work").glob("run-*"):
        for request in (work / "requests").glob(f"{action}-*.json"):
            try:
                out.add(int(json.loads(request.read_text())["config"]["global_round"]))
            except (ValueError, KeyError):  # being written
                continue
    return out


@pytest.mark.slow  # ~3 min: make test-deploy
def test_bhfl_with_a_deadline_root_and_buffered_nodes_leaves_a_cut_off_node_out_and_merges_it_stale(
        tmp_path: Path) -> None:
    """B-HFL, the root closing its rounds at a 25 s deadline (late replies merged in the round they
    come in), the level-1 nodes buffered (their 2 devices kept busy, a round merged at each
    arrival). In the first round r >= 2 that asks node 1, its link to the root is cut as soon as it
    has the request, until round r's fit has closed: round r closes at its deadline with node 0
    alone; round r + 1 does not ask node 1 (its call is still awaited) and merges its reply, one
    merge stale; the buffered nodes merge stale device replies; nothing fails. (Round 1, which
    starts the node servers, may itself close at the deadline: its replies then come in round 2.)"""
    overrides = [*BASE, "algorithm=bhfl", "algorithm.alpha=0.05", "algorithm.team_rounds=2", "global_rounds=4",
                 "eval_every=1", "clock.enabled=true", "clock.policy=[deadline,buffered]",
                 f"clock.deadline={DEADLINE}", "clock.late=next", "clock.buffer=1", "clock.concurrency=[0,2]"]
    cut: list[float] = []
    cut_round: list[int] = []

    def cut_through_a_round(dep: Deployment, out: Path):
        cmd = dep.submit_command(out, *overrides, "runtime=deployment", "runtime.device_wait_seconds=30")
        submit = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_until(lambda: {2, 3} & requests(dep, "1", "fit") or submit.poll() is not None, 600)
        (r,) = sorted({2, 3} & requests(dep, "1", "fit"))[:1]
        dep.proxies["1"].cut()
        cut_round.append(r)
        cut.append(time.monotonic())
        _wait_until(lambda: r in requests(dep, "0", "evaluate") or submit.poll() is not None, 300)
        cut.append(time.monotonic())
        dep.proxies["1"].restore()
        stdout, stderr = submit.communicate(timeout=600)
        return subprocess.CompletedProcess(cmd, submit.returncode, stdout, stderr)

    run_dir, _ = deployed(tmp_path, overrides, during=cut_through_a_round, setup=lambda d: d.fault_proxy("1"))
    (r,) = cut_round
    assert DEADLINE - 5.0 <= cut[1] - cut[0] < 30.0, cut  # round r waited out its deadline
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    asked = {int(row["round"]): row["asked"] for row in rows if row["node"] == "root" and "asked" in row}
    assert asked[r] == ["0", "1"] and asked[r + 1] == ["0"], asked
    lines = {line["round"]: line for line in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert lines[r]["stale_level1"] == 0 and lines[r + 1]["stale_level1"] == 1, (r, lines)
    # The buffered level-1 nodes merged device replies sent before their previous merge.
    assert sum(line.get("stale_level2", 0) for line in lines.values()) >= 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["failures"] == 0


def pending_calls(dep: Deployment, path: str) -> list[dict]:
    """The calls node ``path``'s stored state still awaits (hfl.clock.realtime), newest version."""
    for work in (dep.root / f"node-{path}-work").glob("run-*"):
        try:
            stored = StateStore(work / "state").load(f"node-{path}")
        except Exception:  # noqa: BLE001 - being written: look again
            return []
        if stored and "clock_pending" in stored:
            return json.loads(bytes(stored["clock_pending"]).decode() or "[]")
    return []


@pytest.mark.slow  # ~2 min: make test-deploy
def test_a_node_server_killed_with_device_replies_in_flight_sends_their_calls_again_and_merges_them(
        tmp_path: Path) -> None:
    """FedAvg, the level-1 nodes buffered (buffer 1, both devices kept busy): a node's call ends
    with one device's reply still awaited, stored with its state. SIGKILL node 0's node server then;
    its bridge starts a new one at the next request, which sends that call again (the device
    answers it as it did the first time) and merges the reply, stale: nothing fails, nothing is lost."""
    overrides = [*BASE, "algorithm=hierfavg", "algorithm.team_rounds=2", "global_rounds=3", "eval_every=3",
                 "clock.enabled=true", "clock.policy=[sync,buffered]", "clock.buffer=1", "clock.concurrency=[0,2]"]
    killed: list[int] = []

    def kill_with_calls_awaited(dep: Deployment, out: Path):
        cmd = dep.submit_command(out, *overrides, "runtime=deployment", "runtime.device_wait_seconds=30")
        submit = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_until(lambda: pending_calls(dep, "0") or submit.poll() is not None, 600)
        return kill_node_server_and_finish(dep, cmd, submit, killed)

    run_dir, dep = deployed(tmp_path, overrides, during=kill_with_calls_awaited)
    (work,) = (dep.root / "node-0-work").glob("run-*")
    assert killed and int((work / "server.pid").read_text()) != killed[0]  # a second node server went on
    assert "sending call 0|" in (work / "node.log").read_text()  # the awaited call, sent again
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["failures"] == 0
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["stale_level2"] >= 1
