"""The command lines of the three roles: Flower's own ``flower-superlink`` and
``flower-supernode`` with hfl's node configs. ``hfl-deploy`` runs them; the tests and the
compose file use the same builders, so what is documented is what is tested.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

# Default ports. Flower 1.42 serves every API of a SuperLink on one port, run submission included, so
# the SuperLink listens on loopback (its control port) and the Fleet gate (hfl.deploy.gate) on the
# port its SuperNodes reach.
GLOBAL_PORT = 9092
INNER_PORT = 9192  # an inner node's SuperLink (its children connect there)
NODE_PORT = 9094  # a SuperNode's local API; must differ per SuperNode on one host
LOOPBACK = "127.0.0.1"


def control_port(port: int) -> int:
    """The SuperLink's own (loopback) port behind a gate on ``port``, unless set: the next one."""
    return port + 1

SUPERLINK_DB = "superlink.db"  # a node host's SuperLink state, in its work dir
DEFAULT_STATE_DIR = Path.home() / ".cache" / "hfl" / "device-state"  # a device's state-dir unless set
BIN = Path(sys.executable).parent  # this interpreter's scripts (a venv need not be on PATH)


def executable(name: str) -> str:
    """``name`` from this interpreter's bin directory if it is there, else from PATH."""
    local = BIN / name
    return str(local) if local.exists() else name


def process_env(**extra: str) -> dict[str, str]:
    """The environment for Flower processes: they start their helpers (flower-superexec,
    flwr-serverapp, flwr-clientapp) from PATH, so this interpreter's bin directory comes first;
    the SuperExec that starts them looks for work every 0.25 s (Flower's default: 1 s) unless the
    environment says otherwise."""
    # Telemetry: Flower's processes report to Flower Labs unless told not to; hfl's are off unless the
    # operator's environment says otherwise.
    return {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.25", "FLWR_TELEMETRY_ENABLED": "0", **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}


def default_signals() -> None:
    """``preexec_fn`` of every Flower process hfl starts: umask 0077, and SIGINT and SIGQUIT back to their default.
    A shell starts background jobs with them ignored, and an ignored disposition outlives exec: a
    ServerApp or ClientApp would then never hear the SIGINT Flower's parent monitor sends it when
    its SuperLink or SuperNode is gone, and would linger (seen after a backgrounded test run)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    os.umask(0o077)  # what a role writes (superlink.db, state, mailboxes) is its owner's alone, as under hfl-deploy


@dataclass(frozen=True)
class ServerTls:
    """A SuperLink's TLS files: Flower's ``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_dir(cls, directory: str | Path) -> ServerTls:
        d = Path(directory)
        tls = cls(d / "ca.crt", d / "server.pem", d / "server.key")
        missing = [str(p) for p in (tls.ca, tls.cert, tls.key) if not p.exists()]
        if missing:
            raise FileNotFoundError(f"TLS files missing: {', '.join(missing)} (hfl-deploy certs makes them)")
        return tls


def toml_value(value: object) -> str:
    """A TOML literal, as Flower's run and node configs read them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def node_config(values: dict[str, object]) -> str:
    """``--node-config`` text: space-separated key=TOML value."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


def superlink_command(host: str, port: int, tls: ServerTls | None, supernode_auth: bool = False,
                      database: str | Path | None = None) -> list[str]:
    """``database``: Flower's SQLite state file. A SuperLink started again on the same file knows
    its SuperNodes, which go on under their node ids; in memory (None) they are strangers to it."""
    cmd = ["flower-superlink", "--disable-runtime-dependency-installation", "--host", host, "--port", str(port)]
    if database:
        cmd += ["--database", str(database)]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca), "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)]
    if supernode_auth:
        cmd.append("--enable-supernode-auth")
    return cmd


def supernode_command(
    superlink: str,
    port: int,
    config: dict[str, object],
    root_certificates: str | Path | None = None,
    auth_key: str | Path | None = None,
    warm: bool = False,
) -> list[str]:
    """Flower's flower-supernode, its idle poll shortened (hfl.deploy.supernode), its runtime API on
    loopback ``port``; ``warm``: it starts no process per message, the host's runner takes its tasks."""
    cmd = [sys.executable, "-m", "hfl.deploy.supernode", "--superlink", superlink, "--port", str(port), "--node-config", node_config(config)]
    cmd += ["--isolation", "process"] if warm else []
    cmd += ["--root-certificates", str(root_certificates)] if root_certificates else ["--insecure"]
    if auth_key:
        cmd += ["--auth-supernode-private-key", str(auth_key)]
    return cmd


def gate_command(host: str, port: int, upstream_port: int, tls: ServerTls | None) -> list[str]:
    """The Fleet gate on ``host:port`` in front of the SuperLink on loopback ``upstream_port``."""
    cmd = [sys.executable, "-m", "hfl.deploy.gate", "--host", host, "--port", str(port),
           "--upstream", f"{LOOPBACK}:{upstream_port}"]
    return cmd + (["--tls", str(tls.cert.parent)] if tls else [])


def fronted_superlink(host: str, port: int, tls: ServerTls | None, supernode_auth: bool,
                      database: str | Path | None, control: int | None, control_host: str) -> list[list[str]]:
    """A SuperLink on ``control_host:control`` (loopback unless the operator says otherwise) and,
    on ``host:port``, the gate that lets its SuperNodes in and nothing else."""
    control = control_port(port) if control is None else control
    if control == port:
        raise ValueError(f"the control port {control} must differ from the Fleet port {port}")
    return [superlink_command(control_host, control, tls, supernode_auth, database),
            gate_command(host, port, control, tls)]


def global_role(host: str = "0.0.0.0", port: int = GLOBAL_PORT, tls: ServerTls | None = None,
                supernode_auth: bool = False, database: str | Path | None = None, *,
                control: int | None = None, control_host: str = LOOPBACK) -> list[list[str]]:
    """The root's host: its SuperLink (run submission on ``control_host:control``, loopback by
    default) and its Fleet gate on ``host:port``."""
    return fronted_superlink(host, port, tls, supernode_auth, database, control, control_host)


def node_role(
    path: str,
    parent_superlink: str,
    work_dir: str | Path,
    *,
    host: str = "0.0.0.0",
    port: int = INNER_PORT,
    node_port: int = NODE_PORT,
    tls: ServerTls | None = None,
    parent_ca: str | Path | None = None,
    supernode_auth: bool = False,
    auth_key: str | Path | None = None,
    control: int | None = None,
    control_host: str = LOOPBACK,
    per_message: bool = False,
) -> list[list[str]]:
    """An inner node's host at ``path`` (any level): its SuperLink for its children (its state in
    ``work_dir``/superlink.db, so that it can be started again; submission on loopback
    ``control``), the Fleet gate its children reach on ``host:port``, the bridge SuperNode
    toward its parent's SuperLink (hfl.deploy.bridge) and the runner that takes its messages
    (hfl.deploy.runner; none with ``per_message`` or a Flower the runner does not serve: then
    Flower starts a process per message)."""
    link, gate = fronted_superlink(host, port, tls, supernode_auth, Path(work_dir) / SUPERLINK_DB, control,
                                   control_host)
    own = control_port(port) if control is None else control
    bridge: dict[str, object] = {
        "role": "node", "path": path, "node-superlink": f"{LOOPBACK}:{own}",  # its own SuperLink, on loopback
        "node-root-certificates": str(tls.ca) if tls else "", "work-dir": str(work_dir),
    }
    warm = uses_runner(per_message)
    commands = [link, gate, supernode_command(parent_superlink, node_port, bridge, parent_ca, auth_key, warm)]
    return commands + ([runner_command(node_port)] if warm else [])


def uses_runner(per_message: bool) -> bool:
    """Whether a host's SuperNode hands its messages to a warm runner (hfl.deploy.runner)."""
    if per_message:
        return False
    from hfl.deploy.runner import runner_supported

    return runner_supported()


def runner_command(node_port: int) -> list[str]:
    """The host's runner, taking the tasks of the SuperNode whose runtime API is on loopback ``node_port``."""
    return [sys.executable, "-m", "hfl.deploy.runner", "--runtime-api", f"{LOOPBACK}:{node_port}"]


def device_role(
    device_id: int,
    node_superlink: str,
    *,
    node_port: int = NODE_PORT,
    state_dir: str | Path | None = None,
    data_path: str | Path | None = None,
    node_ca: str | Path | None = None,
    auth_key: str | Path | None = None,
    per_message: bool = False,
) -> list[list[str]]:
    """A device host: its SuperNode, and the process that answers its messages: the runner
    (hfl.deploy.runner), which runs the device's ClientApp in itself, or with ``per_message`` (or a
    Flower the runner does not serve) the worker (hfl.deploy.device_worker) that the ClientApp
    process Flower starts per message relays to."""
    config: dict[str, object] = {"role": "device", "device-id": device_id}
    worker = [sys.executable, "-m", "hfl.deploy.device_worker", "--device-id", str(device_id)]
    if state_dir:
        config["state-dir"] = str(state_dir)
        worker += ["--state-dir", str(state_dir)]
    if data_path:
        config["data-path"] = str(data_path)
        worker += ["--data-path", str(data_path)]
    if uses_runner(per_message):
        return [supernode_command(node_superlink, node_port, config, node_ca, auth_key, warm=True), runner_command(node_port)]
    return [supernode_command(node_superlink, node_port, config, node_ca, auth_key), worker]


def flwr_home_config(name: str, address: str, root_certificates: str | Path | None) -> str:
    """``$FLWR_HOME/config.toml`` with one SuperLink connection."""
    security = f"root-certificates = {json.dumps(str(root_certificates))}" if root_certificates else "insecure = true"
    return f'[superlink]\ndefault = "{name}"\n[superlink.{name}]\naddress = {json.dumps(address)}\n{security}\n'
