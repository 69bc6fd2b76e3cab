"""Real processes: flower-superlink / flower-supernode on loopback ports, the root's SuperLink, a
host per inner node (SuperLink + bridge SuperNode + node server), a SuperNode per device, each
deployed run compared with runtime=inprocess. Minutes, so behind the ``deployment`` marker:
``make test`` runs them after the default suite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import compose_cfg

from hfl.deploy import roles
from hfl.deploy.certs import make_node_key, make_tls
from hfl.deploy.control import ControlClient
from hfl.deploy.loopback import Deployment, free_ports, wait_port
from hfl.deploy.netns import available as why_no_netns
from hfl.deploy.roles import ServerTls
from hfl.runtime.build import federation_for
from hfl.runtime.simulate import run
from hfl.deploy.device import REPLY
from hfl.device.state import stored_device_states
from hfl.state.store import StateStore
from hfl.tree.shape import from_teams

pytestmark = pytest.mark.deployment

BASE = [
    "topology.num_teams=2",
    "topology.devices_per_team=2",
    "dataset.max_samples=300",
    "dataset.batch_size=32",
    "algorithm.local_steps=5",
    "algorithm.alpha=0.05",
    "runtime.torch_threads=1",
]


def deployed(tmp_path: Path, overrides: list[str], tls: ServerTls | None = None, during=None,
             setup=None, netns: bool = False, auth: bool = False, per_message: bool = False) -> tuple[Path, Deployment]:
    """Run the experiment on a fresh deployment (``setup(dep)`` before it starts, ``during(dep,
    out)`` to submit and meddle; ``netns``: every host in a network namespace of its own; ``auth``:
    SuperNode authentication on every SuperLink; ``per_message``: Flower's process per message on
    every host instead of its runner); return its output directory."""
    dep = Deployment(tmp_path / "deploy", federation_for(compose_cfg(*overrides)).tree, tls, netns=netns, auth=auth,
                     per_message=per_message)
    dep.root.mkdir(parents=True)
    out = tmp_path / "out"
    try:
        if setup is not None:
            setup(dep)
        dep.start()
        if during is None:
            result = dep.submit([*overrides, "runtime=deployment", "runtime.device_wait_seconds=30"], out)
        else:
            result = during(dep, out)
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}\n{dep.logs()}"
    finally:
        dep.stop()
    (run_dir,) = out.iterdir()
    return run_dir, dep


def simulated(tmp_path: Path, overrides: list[str]) -> Path:
    """The in-process run of the same config, its devices one by one as a deployment's are (the
    batched path sums in another order: float noise that Adam's normalisation can amplify)."""
    run(compose_cfg(*overrides, "runtime=inprocess", "runtime.batched=off"), tmp_path / "sim")
    return tmp_path / "sim"


def model(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoints" / "global_model.npz") as f:
        return [f[k] for k in sorted(k for k in f.files if k.startswith("arr_"))]


def final_line(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def assert_same_run(deploy_dir: Path, sim_dir: Path) -> None:
    for a, b in zip(model(deploy_dir), model(sim_dir), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    dep, sim = final_line(deploy_dir), final_line(sim_dir)
    figures = [k for k in sim if k.endswith("_accuracy")]
    assert figures
    for key in figures:
        assert dep[key] == (None if sim[key] is None else pytest.approx(sim[key], abs=1e-9)), key


@pytest.mark.parametrize("per_message", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["runner", "per-message"])
def test_two_global_rounds_over_tls_and_supernode_auth_match_in_process(tmp_path: Path, per_message: bool) -> None:
    """2 level-1 node hosts x 2 devices, every SuperLink serving TLS and admitting only registered
    SuperNodes (the bridges' keys registered with the root's SuperLink, the devices' with their
    node's): the in-process run's models, whether each host's runner takes its messages or Flower
    starts a process per message (the fallback)."""
    paths = make_tls(tmp_path / "tls", ["localhost"])
    tls = ServerTls(paths["ca"], paths["cert"], paths["key"])
    overrides = [*BASE, "global_rounds=2", "eval_every=2", "algorithm.team_rounds=2"]
    run_dir, dep = deployed(tmp_path, overrides, tls, auth=True, per_message=per_message)
    supernodes = [c for n, c in dep.commands.items() if n.startswith(("bridge-", "device"))]
    assert all(("--isolation" in c) != per_message for c in supernodes)
    executors = sorted(" ".join(c[1:3]) for n, c in dep.commands.items() if n.startswith(("runner-", "worker")))
    assert executors == (["-m hfl.deploy.device_worker"] * 4 if per_message else ["-m hfl.deploy.runner"] * 6)
    assert sorted(p.name for p in (dep.root / "keys").glob("*.pub")) == [
        "bridge-0.pub", "bridge-1.pub", "device0.pub", "device1.pub", "device2.pub", "device3.pub"]
    links = ["global", *[f"link-{p}" for p in dep.inner]]
    assert all("--enable-supernode-auth" in dep.commands[n] for n in links)
    supernodes = [c for n, c in dep.commands.items() if n.startswith(("bridge-", "device"))]
    assert len(supernodes) == 6 and all("--auth-supernode-private-key" in c for c in supernodes)
    assert "--insecure" not in (dep.root / "global.log").read_text()
    assert all("--insecure" not in (dep.root / f"link-{p}.log").read_text() for p in dep.inner)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["failures"] == 0
    sim_dir = simulated(tmp_path, overrides)
    assert_same_run(run_dir, sim_dir)
    assert_same_states(dep, run_dir, sim_dir)


def assert_same_states(dep: Deployment, deploy_dir: Path, sim_dir: Path) -> None:
    """Every inner node's stored state (on its host) and every device's (on its host) equal the
    in-process run's."""
    sim = StateStore(sim_dir / "state")
    for path in dep.inner:
        (work,) = (dep.root / f"node-{path}-work").glob("run-*")
        here, there = StateStore(work / "state").load(f"node-{path}"), sim.load(f"node-{path}")
        assert here is not None and there is not None and sorted(here) == sorted(there), path
        for key in there:
            np.testing.assert_allclose(here[key], there[key], rtol=1e-5, atol=1e-6, err_msg=f"node {path}: {key}")
    devices = stored_device_states(sim)
    for d in dep.tree.devices_under(""):
        (folder,) = (dep.root / f"device{d}-state").glob("run-*")
        here = StateStore(folder).load(f"device-{d}")
        if d not in devices:  # never trained (not sampled): no state on either side
            assert here is None, d
            continue
        here = {k: v for k, v in here.items() if not k.startswith(REPLY)} if here is not None else None  # its last reply
        assert here is not None and sorted(here) == sorted(devices[d]), d
        for key, value in devices[d].items():
            np.testing.assert_allclose(here[key], value, rtol=1e-5, atol=1e-6, err_msg=f"device {d}: {key}")


def test_four_tier_bhfl_matches_in_process(tmp_path: Path) -> None:
    """Root -> 1 -> 2 -> 4 devices, every inner node on a host of its own, B-HFL with proxy training,
    residual edges and Adam upward: the root's, every node's and every device's models are those
    of runtime=inprocess. One level-1 node: an inner node relaying to two inner nodes below it is
    what depth 4 adds (the root's two children are the 3-tier tests'), at half the hosts of [2,2,2]."""
    overrides = ["algorithm=bhfl", "topology=tree", "topology.fanout=[1,2,2]", "dataset.max_samples=200",
                 "dataset.proxy_fraction=0.2", "algorithm.proxy_samples=[40,20,0]", "algorithm.residual_down=true",
                 "algorithm.residual_up_k=1", "algorithm.up.optimizer=adam", "algorithm.up.lr=0.5", "global_rounds=2",
                 "eval_every=2", "algorithm.level_rounds=[1,1]",
                 "algorithm.local_steps=5", "dataset.batch_size=32", "runtime.torch_threads=1"]
    run_dir, dep = deployed(tmp_path, overrides)
    assert len(dep.inner) == 3
    sim_dir = simulated(tmp_path, overrides)
    assert_same_run(run_dir, sim_dir)
    assert_same_states(dep, run_dir, sim_dir)


STATEFUL = {
    # device sampling across the tree: the root draws devices, nodes ask the children holding them
    "pflego": ["algorithm=pflego", "model=mlp", "model.hidden=8", "dataset.partition=roundrobin",
               "dataset.classes_per_device=2", "dataset.max_samples=120", "dataset.batch_size=100000",
               "algorithm.local_steps=5", "algorithm.sample_fraction=0.5", "algorithm.server_lr=0.05"],
    # loss-aware choice of children (hfl.node.cohort) at the root and at the level-1 nodes' hosts
    "power_of_choice": ["algorithm=fedavg", "dataset.max_samples=200", "algorithm.sample_fraction=[0.5,0.67]",
                        "algorithm.candidates=[1,1]", "algorithm.team_rounds=2"],
    # named parts relayed both ways, group models kept by the root
    "femam": ["algorithm=femam", "dataset=synthetic_multilevel", "dataset.clusters=[2]", "dataset.scales=[1.0,1.0,0.3]",
              "dataset.val_fraction=0.2", "model=mclr", "algorithm.levels=[1,2,0]", "algorithm.rounds_per_level=[1,1,1]",
              "algorithm.prune_window=2", "dataset.batch_size=32", "algorithm.local_epochs=1", "algorithm.alpha=0.05"],
    # central DP at the lowest servers (seeded noise, adaptive clipping's C kept in their state); local DP on devices
    "dp_lowest": ["algorithm=fedavg", "dataset.max_samples=200", "algorithm.team_rounds=2", "privacy.level=lowest",
                  "privacy.clip=0.5", "privacy.adaptive=true", "privacy.count_stddev=1.0", "privacy.noise_multiplier=0.8"],
    "dp_local": ["algorithm=fedavg", "dataset.max_samples=200", "algorithm.team_rounds=2", "privacy.level=local",
                 "privacy.clip=0.5", "privacy.noise_multiplier=0.8"],
}


@pytest.mark.slow  # not in make test's time budget: make test-deploy, or pytest -m deployment
@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_stateful_algorithms_match_in_process(tmp_path: Path, name: str) -> None:
    rounds = 3 if name in ("femam", "power_of_choice") else 2  # FeMAM reaches its personal level in round 3
    devices = 3 if name in ("pflego", "power_of_choice") else 2  # PFLEGO's 2 classes a device: 5 devices at least cover MNIST's 10
    overrides = [*STATEFUL[name], "topology.num_teams=2", f"topology.devices_per_team={devices}", f"global_rounds={rounds}",
                 f"eval_every={rounds}", "runtime.torch_threads=1"]
    run_dir, dep = deployed(tmp_path, overrides)
    sim_dir = simulated(tmp_path, overrides)
    assert_same_run(run_dir, sim_dir)
    assert_same_states(dep, run_dir, sim_dir)
    if name.startswith("dp_"):  # the same noise, clipping and accounting as in process
        sim, dep_line = final_line(sim_dir), final_line(run_dir)
        assert dep_line["dp_epsilon"] == sim["dp_epsilon"] and 0 < sim["dp_epsilon"] < float("inf")
        assert {k: v for k, v in dep_line.items() if k.startswith("dp_clipped")} == \
            {k: v for k, v in sim.items() if k.startswith("dp_clipped")}
    if name == "power_of_choice":  # the same children chosen by the same losses, on every host as in process
        sim_rows, dep_rows = ((d / "samples.jsonl").read_text().splitlines() for d in (sim_dir, run_dir))
        assert dep_rows == sim_rows
        chose = [json.loads(r) for r in sim_rows]
        assert {r["node"] for r in chose} == {"root", "0", "1"}
        assert any(loss is not None for r in chose if r["node"] == "root" for loss in r["losses"])


def answered(work: Path, action: str) -> dict[int, dict]:
    """A node server's answers (hfl.deploy.mailbox) by global round: the metrics it replied."""
    out = {}
    for reply in (work / "replies").glob(f"{action}-*.json"):
        request = json.loads((work / "requests" / reply.name).read_text())
        out[int(request["config"]["global_round"])] = json.loads(reply.read_text())
    return out


def kill_node_server_and_finish(dep: Deployment, cmd: list[str], submit: subprocess.Popen,
                                killed: list[int]) -> subprocess.CompletedProcess:
    """SIGKILL level-1 node 0's server process (its pid recorded in ``killed``), then wait for the
    submission to end; what it printed and its exit code."""
    (pid_file,) = (dep.root / "node-0-work").glob("run-*/server.pid")
    killed.append(int(pid_file.read_text()))
    os.kill(killed[0], signal.SIGKILL)
    stdout, stderr = submit.communicate(timeout=600)
    return subprocess.CompletedProcess(cmd, submit.returncode, stdout, stderr)


def _wait_until(check, timeout: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not reached in {timeout} s"
        time.sleep(0.5)


@pytest.mark.slow  # not in make test's time budget: make test-deploy, or pytest -m deployment
def test_killed_device_is_counted_and_rejoins(tmp_path: Path) -> None:
    overrides = [*BASE, "global_rounds=3", "eval_every=3", "algorithm.team_rounds=1", "algorithm.min_fit_fraction=0.5"]
    def kill_then_restart(dep: Deployment, out: Path):
        victim = dep.tree.devices("0")[0]
        cmd = dep.submit_command(out, *overrides, "runtime=deployment", "runtime.device_wait_seconds=20",
               "runtime.team_round_timeout=45")
        submit = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        work = dep.root / "node-0-work"
        _wait_until(lambda: any(work.glob("run-*")), 300)
        (run,) = work.glob("run-*")
        _wait_until(lambda: 1 in answered(run, "fit"), 300)
        dep.kill(f"device{victim}")          # dies between global rounds 1 and 2
        _wait_until(lambda: 2 in answered(run, "fit"), 300)
        dep.start_device(victim)             # comes back before round 3
        stdout, stderr = submit.communicate(timeout=600)
        return subprocess.CompletedProcess(cmd, submit.returncode, stdout, stderr)

    run_dir, dep = deployed(tmp_path, overrides, during=kill_then_restart)
    victim = dep.tree.devices("0")[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 3
    assert summary["failures"] >= 1
    (work,) = (dep.root / "node-0-work").glob("run-*")
    fits = {r: reply["config"] for r, reply in answered(work, "fit").items()}
    assert [fits[r]["failures_level2"] for r in (1, 2, 3)] == [0, 1, 0], "the restarted device did not rejoin"
    evaluation = answered(work, "evaluate")[3]["config"]
    devices = [d for d, _, _ in json.loads(evaluation["pm_devices"])]
    assert victim in devices  # its personalized model survived the crash on its host


def test_a_node_server_killed_mid_round_is_started_again_and_the_run_ends_as_if_never_killed(tmp_path: Path) -> None:
    """SIGKILL the level-1 node 0's node server in global round 2 (the last), once one of its devices has
    answered that round: its bridge starts a new one, which takes the round up again (the device
    that had answered gives the same reply without training twice), and every model ends as
    in the in-process run."""
    overrides = [*BASE, "global_rounds=2", "eval_every=2", "algorithm.team_rounds=1"]
    killed: list[int] = []

    def kill_mid_round(dep: Deployment, out: Path):
        cmd = dep.submit_command(out, *overrides, "runtime=deployment", "runtime.device_wait_seconds=30")
        submit = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        devices = dep.tree.devices("0")

        def answered_round_two() -> bool:
            for d in devices:
                for folder in (dep.root / f"device{d}-state").glob("run-*"):
                    stored = StateStore(folder).load(f"device-{d}")
                    if stored is not None and str(stored.get(f"{REPLY}round")) == "2.1":
                        return True
            return False

        _wait_until(answered_round_two, 300)
        return kill_node_server_and_finish(dep, cmd, submit, killed)

    run_dir, dep = deployed(tmp_path, overrides, during=kill_mid_round)
    (work,) = (dep.root / "node-0-work").glob("run-*")
    assert int((work / "server.pid").read_text()) != killed[0]  # a second node server finished the run
    sim_dir = simulated(tmp_path, overrides)
    assert_same_run(run_dir, sim_dir)
    assert_same_states(dep, run_dir, sim_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["failures"] == 0


def asked_round(work: Path, global_round: int) -> bool:
    """The node server's mailbox holds its parent's fit request of ``global_round``."""
    for request in (work / "requests").glob("fit-*.json"):
        if int(json.loads(request.read_text())["config"]["global_round"]) == global_round:
            return True
    return False


def kill_root_serverapp(dep: Deployment) -> list[int]:
    """SIGKILL the flwr-serverapp process of the root's run (started by the global SuperLink)."""
    found = subprocess.run(["pgrep", "-f", f"flwr-serverapp.*127.0.0.1:{dep.ports['control-global']}"], capture_output=True,
                           text=True, check=False).stdout.split()
    for pid in found:
        os.kill(int(pid), signal.SIGKILL)
    return [int(p) for p in found]


@pytest.mark.slow  # ~8 minutes: make test-deploy, or pytest -m deployment
def test_every_kind_of_process_killed_mid_round_and_started_again_ends_as_never_killed(tmp_path: Path) -> None:
    """One run, one crash of each kind, each mid-round and each started again with its own
    command: round 1 a device SuperNode and another device's runner; round 2 node 0's bridge SuperNode and node 1's SuperLink
    (its node server goes with it); round 3 the root's ServerApp; round 4 the global SuperLink
    (hfl-deploy submit submits the root again, resuming). Every model and state ends as in the
    in-process run; no round counted a failure."""
    overrides = [*BASE, "global_rounds=4", "eval_every=4", "algorithm.team_rounds=1"]
    crashes: list[str] = []

    def chaos(dep: Deployment, out: Path):
        cmd = dep.submit_command(out, "--run-name", "chaos", *overrides, "runtime=deployment",
               "runtime.device_wait_seconds=60")
        submit = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        node0 = dep.root / "node-0-work"

        def at_round(r: int) -> None:
            _wait_until(lambda: any(asked_round(w, r) for w in node0.glob("run-*")), 600)

        device = dep.tree.devices("0")[0]
        device_log = dep.root / f"device{device}.log"
        at_round(1)
        _wait_until(lambda: "Receiving: train message" in device_log.read_text(errors="replace"), 300)
        dep.kill(f"device{device}")  # its fit message in hand
        dep.start_device(device)
        crashes.append("device")
        other = dep.tree.devices("1")[0]
        other_log = dep.root / f"device{other}.log"
        _wait_until(lambda: "Receiving: train message" in other_log.read_text(errors="replace"), 300)
        dep.kill(f"worker{other}")  # the device host's runner, a task of round 1 in hand or about to be
        dep.start_process(f"worker{other}", dep.commands[f"worker{other}"])  # beside its SuperNode, still running
        crashes.append("device runner")
        at_round(2)
        dep.kill("bridge-0")
        dep.kill("link-1")
        dep.start_node("0", ("bridge",))
        dep.start_node("1", ("link",))
        crashes.append("bridge, node SuperLink")
        at_round(3)
        _wait_until(lambda: kill_root_serverapp(dep), 60)
        crashes.append("root ServerApp")
        at_round(4)
        dep.kill("global")
        dep.start_global()
        crashes.append("global SuperLink")
        stdout, stderr = submit.communicate(timeout=900)
        return subprocess.CompletedProcess(cmd, submit.returncode, stdout, stderr)

    run_dir, dep = deployed(tmp_path, overrides, during=chaos)
    assert len(crashes) == 5
    sim_dir = simulated(tmp_path, overrides)
    assert_same_run(run_dir, sim_dir)
    assert_same_states(dep, run_dir, sim_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["failures"] == 0
    assert "resuming the run" in (run_dir / "root.log").read_text()
    assert "sending its message again" in next((dep.root / "node-0-work").glob("run-*/node.log")).read_text()


@pytest.mark.slow  # make test-deploy, or pytest -m deployment
def test_a_slow_link_cut_mid_round_delays_the_run_and_changes_nothing(tmp_path: Path) -> None:
    """Every host in a network namespace of its own, with its own address (the root, each node
    host, each device). Node 0's bridge reaches the root's SuperLink through a proxy adding 30 ms each way; in
    global round 2 the link is cut (open connections reset, new ones refused) until the bridge has
    tried to reconnect, and then restored. The bridge's SuperNode reconnects by itself; every model ends as in the in-process
    run, with no failure counted."""
    if why_no_netns() is not None:
        pytest.skip(why_no_netns())
    overrides = [*BASE, "global_rounds=3", "eval_every=3", "algorithm.team_rounds=1"]

    def cut_mid_round(dep: Deployment, out: Path):
        cmd = dep.submit_command(out, *overrides, "runtime=deployment", "runtime.device_wait_seconds=30")
        submit = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        node0 = dep.root / "node-0-work"
        _wait_until(lambda: any(asked_round(w, 2) for w in node0.glob("run-*")), 600)
        proxy = dep.proxies["0"]
        proxy.cut()
        # Down until the bridge has tried to reconnect (its SuperNode notices a dead connection at
        # its next request: seconds), and a little longer.
        _wait_until(lambda: proxy.counts["refused"] >= 1, 120)
        time.sleep(3)
        proxy.restore()
        stdout, stderr = submit.communicate(timeout=600)
        return subprocess.CompletedProcess(cmd, submit.returncode, stdout, stderr)

    counts: list[dict] = []
    run_dir, dep = deployed(tmp_path, overrides, during=cut_mid_round, netns=True,
                            setup=lambda d: counts.append(d.fault_proxy("0", delay=0.03).counts))
    device = dep.tree.devices("0")[0]  # each host reached at its own address
    assert f"channel to {dep.link_of('0')}." in (dep.root / f"device{device}.log").read_text()
    assert dep.link_of("0").startswith("10.") and dep.link_of("0") != dep.link_of("1")
    assert counts[0]["cut"] >= 1 and counts[0]["refused"] >= 1  # the link was really down, and tried
    sim_dir = simulated(tmp_path, overrides)
    assert_same_run(run_dir, sim_dir)
    assert_same_states(dep, run_dir, sim_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["failures"] == 0


def test_supernode_auth_admits_only_registered_nodes(tmp_path: Path) -> None:
    """hfl-deploy's --supernode-auth / node-key / register / --auth-key are Flower's mechanism:
    a registered device connects, an unregistered one is refused."""
    paths = make_tls(tmp_path / "tls", ["localhost"])
    tls = ServerTls(paths["ca"], paths["cert"], paths["key"])
    link_port, control_port, good_port, bad_port = free_ports(4)
    good, good_pub = make_node_key(tmp_path / "keys", "good")
    bad, _ = make_node_key(tmp_path / "keys", "bad")
    dep = Deployment(tmp_path, from_teams([[0]]))
    try:
        link, gate = roles.global_role("127.0.0.1", link_port, tls, supernode_auth=True, control=control_port)
        dep.start_process("link", link)
        dep.start_process("gate", gate)
        wait_port(link_port)
        wait_port(control_port)
        control = ControlClient(f"127.0.0.1:{control_port}", str(tls.ca), tmp_path / "home", Path("."))
        control.register_supernode(good_pub)
        for name, key, port in (("good", good, good_port), ("bad", bad, bad_port)):
            cmd, _ = roles.device_role(0, f"127.0.0.1:{link_port}", node_port=port, node_ca=tls.ca, auth_key=key)
            dep.start_process(name, cmd)
        deadline = time.monotonic() + 60
        while dep.procs["bad"].poll() is None:
            assert time.monotonic() < deadline, "the unregistered SuperNode was not refused"
            time.sleep(0.5)
        assert dep.procs["good"].poll() is None, "the registered SuperNode did not stay connected"
        nodes = json.loads(subprocess.run(
            [roles.executable("flwr"), "supernode", "ls", "hfl", "--format", "json"], capture_output=True, text=True,
            env={**os.environ, "FLWR_HOME": str(tmp_path / "home")}, check=True).stdout)["nodes"]
        assert [n["status"] for n in nodes] == ["online"]
        assert "Failed to activate SuperNode" in (tmp_path / "bad.log").read_text()
    finally:
        dep.stop()


def test_flwr_run_in_one_command_matches_in_process(tmp_path: Path) -> None:
    """``hfl-deploy simulate``: Flower's own ``flwr run .`` on a local simulation SuperLink (its
    five steps done by one command) trains the models an in-process run trains."""
    overrides = [*BASE, "global_rounds=2"]
    done = subprocess.run([roles.executable("hfl-deploy"), "simulate", "--output-dir", str(tmp_path / "flwr"),
                           "--work-dir", str(tmp_path / "work"), *overrides],
                          capture_output=True, text=True, timeout=600, check=False)
    log = (tmp_path / "work" / "superlink.log").read_text()[-3000:] if (tmp_path / "work" / "superlink.log").exists() else ""
    assert done.returncode == 0 and "finished:completed" in done.stdout, f"{done.stdout}\n{done.stderr[-3000:]}\n{log}"
    (run_dir,) = (tmp_path / "flwr").iterdir()
    # it says where the outputs are, each round as it ends, then the summary table
    assert f"outputs in {run_dir}" in done.stdout and "round 1/2" in done.stdout and "round 2/2" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "hfl-deploy simulate: finished:completed"
    assert_same_run(run_dir, simulated(tmp_path, overrides))
    # the run recorded its config, so its report names the seed (it said "seed: —")
    assert json.loads((run_dir / "checkpoints" / "config.json").read_text())["seed"] == 0
    assert "seed: 0" in (run_dir / "report.md").read_text()
    # the SuperLink is gone: nothing listens on its port any more
    assert "SuperLinkLifespan: stop" in (tmp_path / "work" / "superlink.log").read_text()


def test_flwr_run_in_one_command_refuses_a_bad_override_before_starting_anything(tmp_path: Path) -> None:
    done = subprocess.run([roles.executable("hfl-deploy"), "simulate", "--work-dir", str(tmp_path / "work"),
                           "algorithm.local_steps=-1"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "hfl-deploy: algorithm.local_steps: must be >= 1, got -1"]
    assert not (tmp_path / "work" / "superlink.log").exists()
