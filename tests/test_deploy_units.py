"""The deployment pieces without processes: the mailbox between a bridge and its node server,
the device wrapper, role command lines, certificates (the Grid exchange: tests/test_deploy_grid.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_ssh_private_key

from hfl.config.checks import load_module
from hfl.deploy import roles
from hfl.deploy.certs import make_node_key, make_tls
from hfl.deploy.device import (
    DeployedDevice,
    device_client,
    export_device_data,
    load_device_data,
)
from hfl.deploy.bridge import NodeBridge
from hfl.deploy.mailbox import Letter, Mailbox, request_name
from hfl.deploy.wiring import check_role, node_path
from hfl.errors import ConfigError
from hfl.models import build_model
from hfl.runtime.build import device_runtime, federation_for, initial_model
from hfl.runtime.simulate import run
from hfl.state.store import StateStore
from hfl.device.training import LocalTrainer


def test_request_names_follow_the_message_not_its_delivery() -> None:
    config = {"global_round": 3, "payload": "model"}
    assert request_name("fit", config) == request_name("fit", dict(reversed(config.items())))
    assert request_name("fit", config) != request_name("fit", {**config, "global_round": 4})
    assert request_name("fit", config) != request_name("evaluate", config)
    with pytest.raises(ValueError, match="unknown request action 'train'"):
        request_name("train", config)


def test_mailbox_round_trip_and_pending(tmp_path) -> None:
    box = Mailbox(tmp_path / "box")
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, dtype=np.float64)]
    box.post("fit-a", Letter("fit", arrays, {"global_round": 1}))
    box.post("evaluate-b", Letter("evaluate", [], {"global_round": 1}))
    assert box.pending() == ["fit-a", "evaluate-b"]
    got = box.request("fit-a")
    assert got.action == "fit" and got.config == {"global_round": 1}
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(arrays, got.arrays, strict=True))
    assert box.reply("fit-a") is None
    box.answer("fit-a", Letter("fit", arrays[:1], {"node": "0"}, number=7))
    assert box.pending() == ["evaluate-b"]
    reply = box.reply("fit-a")
    assert reply.number == 7 and reply.config == {"node": "0"} and not reply.error
    assert not box.server_alive()
    box.beat()
    assert box.server_alive()


def serve_once(box: Mailbox, answer) -> threading.Thread:  # noqa: ANN001
    """A stand-in node server: beats, answers the first request with ``answer(letter)``."""

    def serve() -> None:
        box.beat()
        while not box.pending():
            time.sleep(0.01)
        name = box.pending()[0]
        box.answer(name, answer(box.request(name)))

    return threading.Thread(target=serve, daemon=True)


def test_bridge_starts_a_node_server_once_and_a_repeated_message_is_not_computed_twice(tmp_path) -> None:
    box = Mailbox(tmp_path / "box")
    starts = []

    def start() -> None:
        starts.append(1)
        serve_once(box, lambda letter: Letter("fit", [a * 2 for a in letter.arrays], {"node": "0"}, number=5)).start()

    bridge = NodeBridge("0", box, start, timeout=30)
    sent = [np.ones(3)]
    arrays, n, metrics = bridge.fit(sent, {"global_round": 1})
    assert np.array_equal(arrays[0], 2 * np.ones(3)) and n == 5 and metrics == {"node": "0"} and starts == [1]
    again, _, _ = bridge.fit(sent, {"global_round": 1})  # delivered again after a restart: the stored answer
    assert np.array_equal(again[0], arrays[0]) and starts == [1]
    assert bridge.get_properties({}) == {"path": "0", "level": 1}


def test_bridge_raises_the_node_servers_error(tmp_path) -> None:
    box = Mailbox(tmp_path / "box")
    bridge = NodeBridge("0.1", box, lambda: serve_once(box, lambda letter: Letter(
        "evaluate", [], {}, error="RuntimeError: no device evaluated the GM model")).start(), timeout=30)
    with pytest.raises(RuntimeError, match=r"node 0\.1: RuntimeError: no device evaluated"):
        bridge.evaluate([], {"global_round": 2})


@pytest.fixture
def device(small_cfg, tmp_path):
    cfg = small_cfg()
    fed = federation_for(cfg)
    trainer = LocalTrainer(build_model(cfg["model"], fed.input_shape, fed.num_classes))
    store = StateStore(tmp_path / "state")
    client = load_module(cfg["algorithm"], "client").make_client(device_runtime(cfg, 0, fed.devices[0], trainer, store))
    return cfg, fed, DeployedDevice(client, store), store


def test_device_says_who_it_is_and_saves_its_state_after_a_fit(device) -> None:
    cfg, fed, node, store = device
    gm = initial_model(cfg, fed)
    assert node.get_properties({}) == {"device_id": 0}
    assert store.load("device-0") is None
    node.fit(gm, {"alpha": 0.05, "local_steps": 3, "prox_coefficient": 0.5})
    saved = store.load("device-0")
    assert saved is not None and int(saved["num_personal"]) == len(gm)
    loss, n, metrics = node.evaluate([], {"model": "personal"})
    alone_loss, alone_n, alone = node.inner.evaluate([], {"model": "personal"})
    assert (loss, n, metrics) == (alone_loss, alone_n, alone)


def test_device_data_file_round_trip_and_errors(small_cfg, tmp_path) -> None:
    cfg = small_cfg()
    export_device_data(cfg, 2, tmp_path / "d.npz")
    data, num_classes = load_device_data(tmp_path / "d.npz", 2)
    fed = federation_for(cfg)
    assert num_classes == fed.num_classes
    assert np.array_equal(data.x_train.numpy(), fed.devices[2].x_train.numpy())
    np.savez(tmp_path / "bad.npz", x_train=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="lacks y_train, x_test, y_test, num_classes"):
        load_device_data(tmp_path / "bad.npz", 0)


def test_roles_must_match_their_superlink() -> None:
    check_role("global", "node")
    check_role("global", "team")
    check_role("global", None)  # simulation's level-1 nodes
    check_role("node", "device")
    check_role("node", "node")
    with pytest.raises(ValueError, match="connected to the global SuperLink"):
        check_role("global", "device")
    with pytest.raises(ValueError, match="unknown SuperNode role 'edge'"):
        check_role("node", "edge")
    assert node_path({"path": "0.1"}) == "0.1" and node_path({"team-id": 2}) == "2"
    with pytest.raises(ValueError, match="needs path"):
        node_path({"role": "node"})


def test_role_commands(tmp_path) -> None:
    paths = make_tls(tmp_path, ["edge-1"])
    tls = roles.ServerTls.from_dir(tmp_path)
    link, gate, bridge, runner = roles.node_role("1.0", "region:9192", "/w", tls=tls, parent_ca="/g/ca.crt",
                                                 node_port=9301)
    # The host's warm runner takes the bridge SuperNode's tasks from its runtime API on loopback (hfl.deploy.runner).
    assert bridge[bridge.index("--isolation") + 1] == "process" and bridge[bridge.index("--port") + 1] == "9301"
    assert runner[1:] == ["-m", "hfl.deploy.runner", "--runtime-api", "127.0.0.1:9301"]
    assert len(roles.node_role("1.0", "region:9192", "/w", per_message=True)) == 3  # Flower's process per message
    assert link[:1] == ["flower-superlink"] and "--insecure" not in link
    # The SuperLink (run submission) on loopback; its children reach the Fleet gate on the role's port.
    assert link[link.index("--host") + 1] == "127.0.0.1" and link[link.index("--port") + 1] == "9193"
    assert gate[1:] == ["-m", "hfl.deploy.gate", "--host", "0.0.0.0", "--port", "9192", "--upstream", "127.0.0.1:9193",
                        "--tls", str(tmp_path)]
    assert link[link.index("--ssl-certfile") + 1] == str(paths["cert"])
    assert link[link.index("--database") + 1] == "/w/superlink.db"  # started again, it knows its SuperNodes
    assert bridge[bridge.index("--superlink") + 1] == "region:9192"
    assert bridge[bridge.index("--root-certificates") + 1] == "/g/ca.crt"
    assert bridge[bridge.index("--node-config") + 1] == (
        f'role="node" path="1.0" node-superlink="127.0.0.1:9193" node-root-certificates="{paths["ca"]}" '
        'work-dir="/w"'
    )
    device, runner = roles.device_role(7, "edge-1:9192", node_port=9300, state_dir="/s")
    assert runner[1:] == ["-m", "hfl.deploy.runner", "--runtime-api", "127.0.0.1:9300"]
    assert device[device.index("--isolation") + 1] == "process"
    device, worker = roles.device_role(7, "edge-1:9192", node_port=9300, state_dir="/s", per_message=True)
    assert worker[1:] == ["-m", "hfl.deploy.device_worker", "--device-id", "7", "--state-dir", "/s"]
    assert "--isolation" not in device
    assert "--insecure" in device and device[device.index("--port") + 1] == "9300"
    assert device[device.index("--node-config") + 1] == 'role="device" device-id=7 state-dir="/s"'
    with pytest.raises(FileNotFoundError, match="hfl-deploy certs"):
        roles.ServerTls.from_dir(tmp_path / "nothing")


def test_certificates_and_node_keys(tmp_path) -> None:
    paths = make_tls(tmp_path, ["superlink-global", "10.0.0.5"])
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"superlink-global", "localhost"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"10.0.0.5", "127.0.0.1"}
    private, public = make_node_key(tmp_path / "keys", "device-3")
    key = load_ssh_private_key(private.read_bytes(), password=None)
    assert key.curve.name == "secp384r1" and public.read_text().startswith("ecdsa-sha2-nistp384 ")


def test_hfl_simulate_refuses_the_deployment_runtime(small_cfg, tmp_path) -> None:
    with pytest.raises(ConfigError, match="hfl-deploy submit"):
        run(small_cfg("runtime=deployment"), tmp_path)


def test_device_from_a_data_file_equals_its_partition(small_cfg, tmp_path) -> None:
    cfg = small_cfg()
    export_device_data(cfg, 4, tmp_path / "d4.npz")
    by_file = device_client(cfg, {"device-id": 4, "data-path": str(tmp_path / "d4.npz"), "state-dir": str(tmp_path)}, "r1")
    by_id = device_client(cfg, {"device-id": 4, "state-dir": str(tmp_path)}, "r2")
    assert (tmp_path / "r2" / "partition-4.npz").exists()  # the next message's process reads it back
    again = device_client(cfg, {"device-id": 4, "state-dir": str(tmp_path)}, "r2")
    a, b, c = by_file.inner.device, by_id.inner.device, again.inner.device
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    for field in ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val"):
        assert torch.equal(getattr(b, field), getattr(c, field)) and getattr(b, field).dtype == getattr(c, field).dtype
    assert by_file.store.root == tmp_path / "r1"  # state lives per global run under state-dir
    with pytest.raises(ValueError, match="device-id 99 does not exist"):
        device_client(cfg, {"device-id": 99, "state-dir": str(tmp_path)}, "r3")
    with pytest.raises(ValueError, match="needs device-id"):
        device_client(cfg, {"state-dir": str(tmp_path)}, "r3")


def test_every_target_in_one_message_per_device_equals_one_message_per_target(device) -> None:
    from tests.test_deploy_grid import MemoryGrid, task_identity  # noqa: F401 - the fixture, used by name

    from flwr.supercore.task_identity import TaskIdentity

    from hfl.deploy.grid import GridProxy, evaluate_targets_together
    from hfl.node.inprocess import client_manager_of
    from hfl.rules.payload import LocalParameters

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    cfg, fed, node, _ = device
    gm = initial_model(cfg, fed)
    team, _, _ = node.fit(gm, {"alpha": 0.05, "local_steps": 3, "prox_coefficient": 0.5})
    asks = [(LocalParameters(gm), {"model": "global"}), (LocalParameters(team), {"model": "team"}),
            (LocalParameters([]), {"model": "personal"})]
    grid = MemoryGrid({7: node})
    answers = evaluate_targets_together(client_manager_of([GridProxy("000000", 7, grid, timeout=5)]), asks)
    for (replies, sent), (params, config) in zip(answers, asks, strict=True):
        loss, n, alone = node.inner.evaluate(params.arrays, config)
        ((cid, res),) = replies
        assert cid == "000000" and res.loss == pytest.approx(loss) and res.num_examples == n
        assert res.metrics == {"device_id": 0, "correct": alone["correct"]}
        assert sent == sum(len(t) for t in params.tensors)
    with pytest.raises(ValueError, match="do not match the 1 arrays"):
        node.evaluate([gm[0]], {"targets": '[[2, {"model": "global"}]]'})


def test_submit_refuses_what_the_tree_does_not_allow_before_connecting(tmp_path) -> None:
    from hfl.deploy.cli import main

    with pytest.raises(SystemExit) as refused:  # nothing listens on port 1: refused before any connection
        main(["submit", "--superlink", "127.0.0.1:1", "--output-dir", str(tmp_path), "algorithm=bhfl", "topology=tree",
              "topology.fanout=[2,2,2]", "algorithm.level_rounds=[1,1,2]"])
    assert str(refused.value) == ("hfl-deploy: algorithm.level_rounds: has 3 entries; this tree of depth 3 needs 2 "
                                  "(levels 1..2)")


@pytest.mark.parametrize("name", ["compose.yaml", "compose.depth3.yaml"])
def test_compose_files_wire_the_topology_they_submit(name) -> None:
    """Every service's command is one hfl-deploy accepts; every node host hangs under its parent's
    host, every device under the lowest node holding it (in the topology the submit service
    sends), every SuperLink's name is in the certificate, and each host keeps its state in a volume."""
    import shlex
    from pathlib import Path

    import yaml

    from hfl.deploy.cli import parser
    from hfl.config.compose import compose_config
    from hfl.tree.shape import parent_of

    compose = yaml.safe_load((Path(__file__).resolve().parents[1] / "docker" / name).read_text())
    services = {s: parser().parse_args(spec["command"]) for s, spec in compose["services"].items()}
    submit = services.pop("submit")
    overrides = [o for o in submit.overrides if not o.startswith("global_rounds")]
    tree = federation_for(compose_config(shlex.join([*overrides, "runtime=deployment"]), 0)).tree
    roots = [s for s, a in services.items() if a.command == "global"]
    # Submitted on the root's host (its network), to its SuperLink's loopback port: never through the gate.
    assert len(roots) == 1 and submit.superlink == f"127.0.0.1:{services[roots[0]].port + 1}"
    assert compose["services"]["submit"]["network_mode"] == f"service:{roots[0]}"
    assert all(a.control_host == "127.0.0.1" for a in services.values() if a.command in ("global", "node", "team"))
    host_of = {"": roots[0]}
    for service, args in services.items():
        if args.command in ("node", "team"):
            host_of[args.path if args.command == "node" else str(args.team_id)] = service
    assert set(host_of) - {""} == set(tree.inner_paths)
    certified = set(services.pop("certs").name)
    for service, args in services.items():
        if args.command == "global":
            assert args.tls == "/tls" and service in certified
            continue
        if args.command == "device":
            (lowest,) = [p for p in tree.nodes_at(tree.depth - 1) if args.device_id in tree.devices(p)]
            parent = host_of[lowest]
        else:
            path = args.path if args.command == "node" else str(args.team_id)
            parent = host_of[parent_of(path)]
            assert args.tls == "/tls" and service in certified
        assert args.parent.split(":")[0] == parent, service
        assert args.parent_ca == "/tls/ca.crt"
        assert any(v.endswith(":/var/lib/hfl") for v in compose["services"][service]["volumes"]), service
    devices = sorted(a.device_id for a in services.values() if a.command == "device")
    assert devices == tree.devices_under("")


GOOD = {"x_train": np.zeros((4, 3), np.float32), "y_train": np.array([0, 1, 2, 1]), "x_test": np.ones((2, 3), np.float32),
        "y_test": np.array([2, 0]), "num_classes": np.array(3)}


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda d: d, None),
    (lambda d: {k: v for k, v in d.items() if k != "y_test"}, "lacks y_test"),
    (lambda d: {**d, "y_train": d["y_train"][:3]}, "x_train has 4 samples but y_train 3 labels"),
    (lambda d: {**d, "y_test": np.array([2, 3])}, "y_test holds labels outside 0..2"),
    (lambda d: {**d, "y_train": d["y_train"].astype(np.float32)}, "y_train must be a 1-D integer array"),
    (lambda d: {**d, "x_test": np.ones((2, 4), np.float32)}, "x_train's samples are (3,) but x_test's (4,)"),
    (lambda d: {**d, "x_train": np.full((4, 3), np.nan, np.float32)}, "x_train holds NaN"),
    (lambda d: {**d, "num_classes": np.array([3, 3])}, "num_classes must be one integer"),
    (lambda d: {**d, "x_train": np.zeros(4, np.float32)}, "x_train must be a numeric array of samples x features"),
    ("truncated", "cannot be read as npz"),
    ("missing", "no such file"),
])
def test_a_device_refuses_a_bad_data_file_before_connecting(tmp_path, damage, problem) -> None:
    from hfl.deploy.cli import main

    path = tmp_path / "dev.npz"
    if damage == "truncated":
        np.savez(path, **GOOD)
        path.write_bytes(path.read_bytes()[:100])
    elif damage != "missing":
        np.savez(path, **damage(GOOD))
    argv = ["device", "--device-id", "0", "--parent", "127.0.0.1:1", "--data-path", str(path), "--print"]
    if problem is None:
        assert main(argv) == 0  # checked, then only printed
        return
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert str(refused.value).startswith(f"hfl-deploy: device data {path}: {problem}")
    assert "\n" not in str(refused.value)


def test_supernode_waits_are_capped_only_on_the_flower_it_was_read_against(monkeypatch) -> None:
    import time as real_time

    import flwr
    from flwr.supernode import start_client_internal as loop

    from hfl.deploy import supernode

    monkeypatch.setattr(loop, "time", real_time)
    monkeypatch.setattr(flwr, "__version__", "9.0.0")
    assert not supernode.shorten_waits(0.01) and loop.time is real_time  # Flower's own loop, untouched
    monkeypatch.setattr(flwr, "__version__", "1.42.0")
    assert supernode.shorten_waits(0.01) and isinstance(loop.time, supernode.CappedSleep)
    slept: list[float] = []
    monkeypatch.setattr(real_time, "sleep", slept.append)
    loop.time.sleep(3)  # the idle poll
    loop.time.sleep(0.001)
    assert slept == [0.01, 0.001] and loop.time.monotonic is real_time.monotonic  # the rest of `time` is time's
    cmd, _ = roles.device_role(7, "edge-1:9192")
    assert cmd[1:3] == ["-m", "hfl.deploy.supernode"]


def test_a_device_asked_again_for_a_round_answers_as_before_without_training_again(device) -> None:
    cfg, fed, node, store = device
    gm = initial_model(cfg, fed)
    config = {"alpha": 0.05, "local_steps": 3, "prox_coefficient": 0.5, "round_path": "1.1"}
    first, n, metrics = node.fit(gm, config)
    state = store.load("device-0")
    again, n2, metrics2 = node.fit(gm, config)  # its node server restarted mid-round
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True)) and (n, metrics) == (n2, metrics2)
    after = store.load("device-0")
    assert sorted(after) == sorted(state) and all(np.array_equal(after[k], state[k]) for k in state)
    node.fit(gm, {**config, "round_path": "1.2"})  # the next round trains
    assert not np.array_equal(store.load("device-0")["personal_0"], state["personal_0"])


class FakeLink:
    """A Control API whose answers are scripted: per call, a (status, details), or an exception."""

    def __init__(self, answers: list) -> None:  # noqa: ANN001
        self.answers = answers
        self.submitted: list[dict] = []
        self.stopped: list[int] = []

    def submit(self, config: dict, config_file) -> int:  # noqa: ANN001
        self.submitted.append(dict(config))
        return 100 + len(self.submitted)

    def run_info(self, run_id: int) -> tuple[str, str]:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def stop(self, run_id: int) -> None:
        self.stopped.append(run_id)


def test_submit_resumes_a_run_lost_with_its_serverapp_but_not_one_that_failed_by_itself(tmp_path) -> None:
    from hfl.deploy.submit import LOST, retriable, see_through

    assert retriable(LOST, "") and retriable("finished:failed", "Task failed because the run expired")
    assert not retriable("finished:failed", "ServerApp failed with exception: global round 2: no level-1 model")
    assert not retriable("finished:completed", "") and not retriable("finished:stopped", "")
    # The global SuperLink goes away (the CLI cannot reach it), comes back, and the run it had
    # expired with its ServerApp: submitted again with resume=true (an old resume= dropped), completed.
    link = FakeLink([("running", ""), RuntimeError("Connection to the SuperLink is unavailable"),
                     ("finished:failed", "Task failed with unknown error."), ("finished:completed", "")])
    config = {"overrides": "global_rounds=4 resume=false", "output-dir": "/o", "run-name": "r", "state-key": "k"}
    lines: list[str] = []
    status = see_through(link, config, tmp_path / "c.toml", timeout=60, restarts=3, reconnect_seconds=30, poll=0.01,
                         say=lines.append)
    assert status == "finished:completed"
    assert [c["overrides"] for c in link.submitted] == ["global_rounds=4 resume=false", "global_rounds=4 resume=true"]
    assert {c["state-key"] for c in link.submitted} == {"k"}  # the hosts keep the same experiment's state
    assert "submitted again, resuming" in lines[2]
    # A ServerApp that raised is reported, not retried; a SuperLink that forgot the run is retried.
    link = FakeLink([("finished:failed", "ServerApp failed with exception: bad")])
    assert see_through(link, config, tmp_path / "c.toml", 60, 3, 30, poll=0.01, say=lines.append) == "finished:failed"
    assert len(link.submitted) == 1
    link = FakeLink([LookupError("Run ID 101 not found"), ("finished:completed", "")])
    assert see_through(link, config, tmp_path / "c.toml", 60, 3, 30, poll=0.01, say=lines.append) == "finished:completed"
    assert len(link.submitted) == 2
    # At most `restarts` submissions again.
    link = FakeLink([LookupError("not found")] * 3)
    assert see_through(link, config, tmp_path / "c.toml", 60, 2, 30, poll=0.01, say=lines.append) == LOST
    assert len(link.submitted) == 3


def test_submit_gives_up_on_a_superlink_away_longer_than_it_waits(tmp_path) -> None:
    from hfl.deploy.submit import follow

    link = FakeLink([RuntimeError("unavailable")] * 50)
    clock = iter(range(0, 1000, 10))
    with pytest.raises(RuntimeError, match="has not answered for 30 s"):
        follow(link, 7, deadline=10_000, reconnect_seconds=30, poll=0, clock=lambda: next(clock), sleep=lambda _: None)


def test_the_fault_proxy_delays_cuts_refuses_and_restores() -> None:
    import socket
    import socketserver

    from hfl.deploy.faultproxy import FaultProxy
    from hfl.deploy.loopback import free_ports

    class Echo(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            while data := self.request.recv(4096):
                self.request.sendall(data)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (port,) = free_ports(1)
    proxy = FaultProxy(port, "127.0.0.1", server.server_address[1], delay=0.1)
    proxy.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            start = time.monotonic()
            conn.sendall(b"ping")
            assert conn.recv(16) == b"ping"
            assert time.monotonic() - start >= 0.2  # 0.1 s each way
            proxy.cut()
            with pytest.raises((ConnectionError, OSError)):  # reset, as a broken link
                conn.sendall(b"x")
                if conn.recv(16) == b"":
                    raise ConnectionResetError("closed")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:  # refused while cut
            assert conn.recv(16) == b""
        proxy.restore()
        proxy.delay = 0.0
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"back")
            assert conn.recv(16) == b"back"
        assert proxy.counts["cut"] == 2 and proxy.counts["refused"] == 1 and proxy.counts["connections"] == 2
    finally:
        proxy.stop()
        server.shutdown()


def test_a_device_worker_answers_as_the_clientapp_would_and_a_dead_one_is_answered_for(small_cfg, tmp_path) -> None:
    import os

    from hfl.deploy.device import device_client
    from hfl.deploy.device_worker import DeviceRelay, serve, worker_box

    cfg = small_cfg()
    gm = initial_model(cfg, federation_for(cfg))
    worker_config = {"role": "device", "device-id": 1, "state-dir": str(tmp_path / "worker")}
    here_config = {"role": "device", "device-id": 1, "state-dir": str(tmp_path / "here")}
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(worker_config, stop), kwargs={"compose": lambda _: cfg}, daemon=True)
    thread.start()
    box = worker_box(worker_config)
    deadline = time.monotonic() + 10
    while not box.server_alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)

    def never() -> None:
        raise AssertionError("the worker is alive: nothing is computed in the ClientApp")

    relay = DeviceRelay(box, "run-k", "global_rounds=2", never)
    conf = {"alpha": 0.05, "local_steps": 3, "prox_coefficient": 0.5, "round_path": "1.1"}
    relayed, n, metrics = relay.fit(gm, conf)
    direct, n2, metrics2 = device_client(cfg, here_config, "run-k").fit(gm, conf)
    assert all(np.array_equal(a, b) for a, b in zip(relayed, direct, strict=True)) and (n, metrics) == (n2, metrics2)
    assert relay.evaluate(gm, {}) == device_client(cfg, here_config, "run-k").evaluate(gm, {})
    assert not list((box.root / "requests").iterdir())  # a relay forgets what it asked
    assert (tmp_path / "worker" / "run-k").is_dir()  # the device's state, where its ClientApp keeps it
    stop.set()
    thread.join(timeout=10)
    os.utime(box.alive_file, (0, 0))  # the worker died: its beat is stale
    fallback = DeviceRelay(box, "run-k", "global_rounds=2", lambda: device_client(cfg, worker_config, "run-k"))
    again, n3, _ = fallback.fit(gm, conf)  # answered here, from the state the worker saved: the same reply
    assert all(np.array_equal(a, b) for a, b in zip(again, relayed, strict=True)) and n3 == n
