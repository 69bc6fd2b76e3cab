"""Deployment hygiene (issue 46): what hfl writes on a deployment host is its owner's alone, keys
are never written through a planted symlink nor silently replaced, run-config values that become
paths stay in their folder on every host that reads them, hfl-deploy's errors are one line, and
a node server whose SuperLink (or parent) is gone ends. Each case: a bad value, a planted file or
a killed process -> a one-line refusal naming the cause, or the process ending; nothing run
through a real deployment (the deployment tests do that)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.common import Context, RecordDict

from hfl.deploy import certs
from hfl.deploy.control import ControlClient
from hfl.deploy.mailbox import Mailbox
from hfl.deploy.private import private_dir, write_private
from hfl.output.paths import confined_dir, confined_name, run_dir
from hfl.errors import ConfigError

HFL_DEPLOY = Path(sys.executable).parent / "hfl-deploy"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def open_umask():
    """The most permissive umask, as a careless host might have: privacy may not rely on it."""
    old = os.umask(0)
    yield
    os.umask(old)


# ---------------------------------------------------------------- keys: 0600 at creation, no symlink followed
def test_tls_keys_are_private_and_certificates_public(tmp_path, open_umask) -> None:
    paths = certs.make_tls(tmp_path / "tls", ["edge"])
    assert mode(tmp_path / "tls") == 0o700
    assert (mode(paths["ca_key"]), mode(paths["key"])) == (0o600, 0o600)
    assert (mode(paths["ca"]), mode(paths["cert"])) == (0o644, 0o644)
    private, public = certs.make_node_key(tmp_path / "keys", "device-3")
    assert (mode(tmp_path / "keys"), mode(private), mode(public)) == (0o700, 0o600, 0o644)
    assert not [p for p in (tmp_path / "tls").iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_private_file_is_never_open_to_others_even_while_written(tmp_path, open_umask) -> None:
    # os.open(..., O_EXCL | O_NOFOLLOW, 0o600): the mode holds from the file's first instant; a
    # file written then chmod-ed (the old way) is 0666 under this umask until the chmod.
    seen: list[int] = []
    real_fdopen = os.fdopen

    def spy(fd, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - os.fdopen's signature
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_fdopen(fd, *args, **kwargs)

    os.fdopen = spy
    try:
        write_private(tmp_path / "k", b"secret")
        write_private(tmp_path / "k", b"again", replace=True)
    finally:
        os.fdopen = real_fdopen
    assert seen == [0o600, 0o600] and (tmp_path / "k").read_bytes() == b"again" and mode(tmp_path / "k") == 0o600


def test_a_symlink_planted_at_a_node_key_is_refused_and_not_written_through(tmp_path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    keys = private_dir(tmp_path / "keys")
    (keys / "device-3").symlink_to(target)
    with pytest.raises(certs.KeyExistsError, match="already holds device-3"):
        certs.make_node_key(keys, "device-3")
    assert target.read_bytes() == b"keep me" and not (keys / "device-3.pub").exists()
    (keys / "gone").symlink_to(tmp_path / "nowhere")  # dangling: O_CREAT would create its target
    with pytest.raises(certs.KeyExistsError):
        certs.make_node_key(keys, "gone")
    assert not (tmp_path / "nowhere").exists()
    with pytest.raises(FileExistsError):  # the race: planted after the check, O_EXCL | O_NOFOLLOW refuses
        write_private(keys / "gone", b"secret")
    assert not (tmp_path / "nowhere").exists()


def test_a_symlink_at_the_ca_key_is_replaced_not_followed(tmp_path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    tls = private_dir(tmp_path / "tls")
    (tls / "ca.key").symlink_to(target)
    with pytest.raises(certs.KeyExistsError, match="--replace-ca"):
        certs.make_tls(tls, ["edge"])
    paths = certs.make_tls(tls, ["edge"], replace_ca=True)
    assert target.read_bytes() == b"keep me"
    assert not paths["ca_key"].is_symlink() and mode(paths["ca_key"]) == 0o600
    assert b"PRIVATE KEY" in paths["ca_key"].read_bytes()


def test_certs_over_an_existing_ca_is_refused_and_changes_nothing(tmp_path) -> None:
    paths = certs.make_tls(tmp_path, ["edge"])
    before = {p: p.read_bytes() for p in paths.values()}
    with pytest.raises(certs.KeyExistsError, match="already holds ca.crt, ca.key"):
        certs.make_tls(tmp_path, ["edge"])
    assert {p: p.read_bytes() for p in paths.values()} == before
    again = certs.make_tls(tmp_path, ["edge"], replace_ca=True)
    assert again["ca"].read_bytes() != before[paths["ca"]]  # told to: a new CA


def test_a_node_key_is_never_overwritten(tmp_path) -> None:
    private, public = certs.make_node_key(tmp_path, "device-3")
    before = private.read_bytes(), public.read_bytes()
    with pytest.raises(certs.KeyExistsError, match="already holds device-3"):
        certs.make_node_key(tmp_path, "device-3")
    assert (private.read_bytes(), public.read_bytes()) == before


# ---------------------------------------------------------------- state, mailboxes, FLWR_HOME, device data: 0700 / 0600
def test_what_a_host_keeps_is_private(tmp_path, open_umask, small_cfg) -> None:
    from hfl.deploy.device import export_device_data, partition

    box = Mailbox(tmp_path / "work" / "run-x")
    assert {mode(tmp_path / "work"), mode(box.root), mode(box.root / "requests"), mode(box.root / "replies")} == {0o700}
    ControlClient("127.0.0.1:1", "", tmp_path / "home", tmp_path)
    assert mode(tmp_path / "home") == 0o700
    cfg = small_cfg()
    partition(cfg, 1, tmp_path / "state" / "run-x")
    assert mode(tmp_path / "state") == mode(tmp_path / "state" / "run-x") == 0o700
    export_device_data(cfg, 1, tmp_path / "d1.npz")
    assert mode(tmp_path / "d1.npz") == 0o600
    with np.load(tmp_path / "d1.npz") as f:
        assert int(f["num_classes"]) >= 2 and len(f["y_train"]) > 0


def test_export_data_refuses_an_id_outside_the_federation(tmp_path, small_cfg) -> None:
    from hfl.deploy.device import export_device_data
    from hfl.runtime.build import federation_for

    cfg = small_cfg()
    devices = len(federation_for(cfg).devices)
    for bad in (-1, devices):  # -1 was the last device, silently
        with pytest.raises(ConfigError, match=rf"--device-id: {bad} is no device .* valid ids are 0\.\.{devices - 1}"):
            export_device_data(cfg, bad, tmp_path / "d.npz")
    assert not (tmp_path / "d.npz").exists()


# ---------------------------------------------------------------- path-like run-config values stay in their folder
BAD_NAMES = ["..", ".", "", "../etc", "a/b", "/abs", "x\ny", "run name"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_a_name_that_would_leave_its_folder_is_refused_naming_the_key(bad) -> None:
    with pytest.raises(ConfigError, match="^state-key: "):
        confined_name("state-key", bad)
    with pytest.raises(ConfigError, match="^run-name: "):
        run_dir({"output-dir": "/srv/out", "run-name": bad or "."}, "t")


@pytest.mark.parametrize("bad", ["relative/out", "/srv/../etc", "", "/srv/out/.."])
def test_an_output_dir_must_be_absolute_without_dotdot(bad) -> None:
    with pytest.raises(ConfigError, match="^output-dir: "):
        run_dir({"output-dir": bad, "run-name": "r1"}, "t")
    with pytest.raises(ConfigError, match="^work-dir: "):
        confined_dir("work-dir", bad)


def test_good_values_pass_unchanged() -> None:
    assert confined_name("state-key", "run-2026-11-28_06-40-00-1a2b3c4d") == "run-2026-11-28_06-40-00-1a2b3c4d"
    assert run_dir({"output-dir": "/srv/out", "run-name": "r.1"}, "t") == Path("/srv/out/r.1")
    assert run_dir({"output-dir": "/srv/out", "run-name": ""}, "t_0") == Path("/srv/out/t_0")
    # `flwr run .` in a simulation: the app's relative default, still without '..'
    assert run_dir({"output-dir": "outputs/flwr"}, "t", absolute=False) == Path("outputs/flwr/t")
    with pytest.raises(ConfigError, match="^output-dir: "):
        run_dir({"output-dir": "../up"}, "t", absolute=False)


def _context(run_config: dict, node_config: dict | None = None) -> Context:
    return Context(run_id=7, node_id=1, node_config=node_config or {}, state=RecordDict(), run_config=run_config)


def test_every_host_that_reads_a_path_value_checks_it(tmp_path) -> None:
    from hfl.deploy.device import device_client
    from hfl.deploy.device_worker import KEY, OVERRIDES, handle
    from hfl.deploy.mailbox import Letter
    from hfl.deploy.wiring import state_key
    from hfl.runtime.apps import _output_dir

    # a bridge or a device (its ClientApp): the state-key names a folder in its work/state dir
    with pytest.raises(ConfigError, match="^state-key: "):
        state_key(_context({"state-key": "../../victim"}))
    assert state_key(_context({"state-key": ""})) == "run-7"
    # the device built in its ClientApp or its worker
    with pytest.raises(ConfigError, match="^state-key: "):
        device_client({"runtime": {"torch_threads": 1}}, {"device-id": 0, "state-dir": str(tmp_path)}, "../x")
    reply = handle(Letter("fit", [], {KEY: "../x", OVERRIDES: ""}), {"device-id": 0, "state-dir": str(tmp_path)},
                   lambda _: pytest.fail("composed for a refused key"))
    assert reply.error.startswith("ConfigError: state-key: ")
    # the root: run-name and output-dir (deployed: absolute)
    with pytest.raises(ConfigError, match="^run-name: "):
        _output_dir(_context({"output-dir": "/srv/out", "run-name": "../../etc"}), deployed=True)
    with pytest.raises(ConfigError, match="^output-dir: "):
        _output_dir(_context({"output-dir": "rel", "run-name": "r"}), deployed=True)
    assert list(tmp_path.iterdir()) == []  # nothing made anywhere


def test_a_node_server_refuses_a_work_dir_or_key_outside_its_folder(tmp_path, small_cfg) -> None:
    from hfl.deploy.node_server import serve_node

    old = os.umask(0o022)
    try:
        for run_config, key in (({"path": "0", "work-dir": "rel", "state-key": "k"}, "work-dir"),
                                ({"path": "0", "work-dir": str(tmp_path), "state-key": ".."}, "state-key")):
            with pytest.raises(ConfigError, match=f"^{key}: "):
                serve_node(None, _context(run_config), small_cfg())
    finally:
        os.umask(old)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- hfl-deploy: one line, non-zero, no traceback
def _deploy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HFL_DEPLOY), *args], capture_output=True, text=True, timeout=120, check=False)


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and lines[0].startswith("hfl-deploy: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_cli_certs_refuses_to_replace_a_ca_unless_told(tmp_path, capsys) -> None:
    from hfl.deploy.cli import main

    out = tmp_path / "tls"
    assert main(["certs", "--out", str(out), "--name", "edge"]) == 0  # the flags' paths in-process (fast) ...
    ca = (out / "ca.key").read_bytes()
    _one_line(_deploy("certs", "--out", str(out), "--name", "edge"), "already holds", "--replace-ca")  # ... refusals too
    assert (out / "ca.key").read_bytes() == ca
    assert main(["certs", "--out", str(out), "--keep-existing"]) == 0  # a compose file's certs step run again
    assert (out / "ca.key").read_bytes() == ca
    assert main(["certs", "--out", str(out), "--replace-ca"]) == 0 and (out / "ca.key").read_bytes() != ca
    with pytest.raises(SystemExit, match="^hfl-deploy: --name: '../escape' must be a single name"):
        main(["node-key", "--out", str(tmp_path / "k"), "--name", "../escape"])


@pytest.mark.parametrize("args, words", [
    (["--device-id", "-1"], ["--device-id: -1", "valid ids are 0.."]),  # >= devices: in-process above
    (["--device-id", "1", "algorithm.alhpa=0.5"], ["algorithm.alhpa", "no such key"]),
])
def test_cli_export_data_refuses_in_one_line(tmp_path, args, words) -> None:
    _one_line(_deploy("export-data", "--out", str(tmp_path / "d.npz"), *args), *words)
    assert not (tmp_path / "d.npz").exists()


def test_cli_unwritable_out_is_one_line(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    _one_line(_deploy("node-key", "--out", str(tmp_path / "file" / "keys"), "--name", "k"), "--out", "a file stands")
    # /sys refuses new files even to root (a chmod-ed folder would not stop root)
    _one_line(_deploy("certs", "--out", "/sys/hfl-tls"), "--out: /sys/hfl-tls", "give --out a directory you can write")


# ---------------------------------------------------------------- a node server whose SuperLink or parent is gone ends
def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed on leaving: nobody listens there


def test_flowers_grid_waits_forever_on_a_gone_superlink_so_the_watch_probes_directly() -> None:
    # Why two node servers outlived their deployment: the look through the Grid never returned.
    from flwr.superlink.grid.http_grid import HttpGrid

    from hfl.deploy.node_server import _superlink_lost

    grid = HttpGrid(runtime_api_address=_dead_address(), insecure=True, token="t")
    grid._connect()
    looked = threading.Event()

    def look() -> None:
        try:
            grid.get_node_ids()
        except Exception:  # noqa: BLE001 - given up below, once shown to wait
            pass
        looked.set()

    threading.Thread(target=look, daemon=True).start()
    assert not looked.wait(1.5)  # still retrying: a count through the Grid never advances
    grid._retry_invoker.max_time = 0  # let it give up (max_tries=1, as Flower's own exit sets, would not)
    started = time.monotonic()
    assert _superlink_lost(grid, 2, timeout=1.0) == 3 and time.monotonic() - started < 2.0


def test_a_node_server_ends_once_its_superlink_is_gone() -> None:
    from flwr.superlink.grid.http_grid import HttpGrid

    from hfl.deploy.node_server import watch_superlink

    ended: list[str] = []
    stop = threading.Event()
    grid = HttpGrid(runtime_api_address=_dead_address(), insecure=True, token="t")
    thread = watch_superlink(grid, stop, name="node 0", every=0.05, misses=3, end=ended.append)
    thread.join(timeout=5.0)
    assert not thread.is_alive() and len(ended) == 1 and "node 0: its SuperLink has not answered" in ended[0]
    # a SuperLink that answers keeps it
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        alive = HttpGrid(runtime_api_address=f"127.0.0.1:{listening.getsockname()[1]}", insecure=True, token="t")
        kept: list[str] = []
        thread = watch_superlink(alive, stop, every=0.05, misses=3, end=kept.append)
        time.sleep(0.4)
        stop.set()
        thread.join(timeout=2.0)
    assert kept == [] and not thread.is_alive()


CHILD = """
import threading, time, sys
from hfl.deploy.node_server import watch_superlink
class Answering:
    def get_node_ids(self):
        return []
watch_superlink(Answering(), threading.Event(), every=0.1)
print("watching", flush=True)
time.sleep(120)
"""
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_node_server_ends_once_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()  # as the SuperExec that started it dies, SIGKILL-ed with its process group
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":  # ended, not yet reaped by init
                break
            time.sleep(0.05)
        else:
            os.kill(child, 9)
            pytest.fail("the orphaned node server was still running 10 s after its parent died")
    finally:
        if parent.poll() is None:
            parent.kill()
