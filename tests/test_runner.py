"""The hosts' warm runner (hfl.deploy.runner) and Flower's shortened pull retries
(hfl.deploy.supernode.shorten_object_pulls), without a deployment; tests/test_deployment.py runs
real hosts with and without the runner."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time

import flwr

from hfl.deploy import roles, runner, supernode
from hfl.deploy.loopback import free_ports, wait_port


def tree(root, files: dict[str, bytes]):  # noqa: ANN001, ANN201
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    return root


def test_a_bundle_is_the_hosts_only_when_every_file_is(tmp_path) -> None:
    files = {"hfl/a.py": b"x = 1\n", "conf/config.yaml": b"seed: 0\n", "strategies/s.py": b"pass\n"}
    host = tree(tmp_path / "host", {**files, "tests/t.py": b"only here\n"})
    bundle = tree(tmp_path / "bundle", {**files, "pyproject.toml": b"[tool.flwr]\n", ".hidden/x": b"y"})
    assert runner.bundle_differs(bundle, host) is None  # the app's metadata and dot folders are not code
    (bundle / "conf" / "config.yaml").write_bytes(b"seed: 1\n")
    assert runner.bundle_differs(bundle, host) == "conf/config.yaml"
    (bundle / "conf" / "config.yaml").write_bytes(b"seed: 0\n")
    tree(bundle, {"hfl/new.py": b"pass\n"})
    assert runner.bundle_differs(bundle, host) == "hfl/new.py"  # code the host does not have


def test_the_runner_serves_this_flower_only(monkeypatch) -> None:
    assert runner.runner_supported()
    assert roles.uses_runner(per_message=False) and not roles.uses_runner(per_message=True)
    monkeypatch.setattr(flwr, "__version__", "1.99.0")
    assert not runner.runner_supported() and not roles.uses_runner(per_message=False)
    # Without the runner a host is Flower's SuperNode starting a process per message, and hfl's worker.
    device, worker = roles.device_role(3, "edge:9192", node_port=9400)
    assert "--isolation" not in device and "hfl.deploy.device_worker" in worker


def test_object_pulls_retry_after_20_ms_not_1_s() -> None:
    from flwr.superlink.grid import http_grid
    from flwr.supernode import start_client_internal
    from flwr.supernode.runtime import run_clientapp

    originals = {m: getattr(m, n) for m, n in ((start_client_internal, "pull_objects"), (http_grid, "pull_objects"),
                                              (run_clientapp, "pull_and_inflate_object_from_tree"))}
    try:
        done = supernode.shorten_object_pulls()
        assert sorted(done) == sorted(supernode.PULLERS)
        for module, original in originals.items():
            name = supernode.PULLERS[module.__name__]
            patched = getattr(module, name)
            assert isinstance(patched, functools.partial) and patched.func is original
            assert patched.keywords == {"initial_backoff": 0.02, "backoff_cap": 0.25}
        assert supernode.shorten_object_pulls() == []  # once per process
    finally:
        for module, original in originals.items():
            setattr(module, supernode.PULLERS[module.__name__], original)


def test_a_runner_waits_for_its_supernode_and_finds_no_task_there(tmp_path) -> None:
    """Against a real SuperNode in process isolation (its SuperLink absent): the runner's asks are
    answered (no task) once the SuperNode's runtime API is up, and it stops when told."""
    (port,) = free_ports(1)
    node = subprocess.Popen([sys.executable, "-m", "hfl.deploy.supernode", "--superlink", "127.0.0.1:9",
                             "--port", str(port), "--isolation", "process", "--insecure",
                             "--node-config", 'role="device" device-id=0'],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
                            env=roles.process_env(FLWR_HOME=str(tmp_path / "home")))
    try:
        served = runner.Runner(f"127.0.0.1:{port}")
        stop = threading.Event()
        thread = threading.Thread(target=served.serve, args=(stop,), daemon=True)
        thread.start()
        wait_port(port, timeout=60)
        time.sleep(0.5)
        assert served.acquire() is None and served.tasks == 0
        stop.set()
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        node.terminate()
        node.wait(timeout=15)


def test_the_runner_refuses_another_flower_in_one_line(tmp_path) -> None:
    code = ("import flwr, sys; flwr.__version__ = '1.99.0'; sys.argv = ['runner', '--runtime-api', '127.0.0.1:9'];"
            "from hfl.deploy.runner import main; main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("hfl.deploy.runner: Flower 1.99.0 is not one")


def test_telemetry_is_off_for_hfls_flower_processes_unless_the_operator_says(monkeypatch) -> None:
    monkeypatch.delenv("FLWR_TELEMETRY_ENABLED", raising=False)
    assert roles.process_env()["FLWR_TELEMETRY_ENABLED"] == "0"
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "1")
    assert roles.process_env()["FLWR_TELEMETRY_ENABLED"] == "1"


def test_a_role_logs_each_process_to_its_file_and_says_one_line_per_change(tmp_path) -> None:
    """``hfl-deploy global`` through its process: a line per process started (naming its log),
    the processes' own output in their files, and one line when one ends."""
    gate, control = free_ports(2)
    logs = tmp_path / "logs"
    role = subprocess.Popen([roles.executable("hfl-deploy"), "global", "--host", "127.0.0.1", "--port", str(gate),
                             "--control-port", str(control), "--log-dir", str(logs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_port(control, timeout=60)
        wait_port(gate, timeout=60)
    finally:
        role.terminate()
        out, _ = role.communicate(timeout=60)
    lines = out.strip().splitlines()
    assert [line.split(" (pid")[0] for line in lines[:2]] == ["hfl-deploy: superlink started", "hfl-deploy: gate started"]
    assert lines[0].endswith(f"log {logs / 'superlink.log'}") and lines[1].endswith(f"log {logs / 'gate.log'}")
    assert lines[2].startswith("hfl-deploy: ") and "ended (exit code" in lines[2]
    assert len(lines) == 3  # nothing else: the processes' output is in their files
    assert "Starting Flower SuperLink" in (logs / "superlink.log").read_text()
    assert oct((logs / "superlink.log").stat().st_mode & 0o777) == "0o600"  # the owner's alone
