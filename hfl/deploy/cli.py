"""hfl-deploy: start the roles of a deployment and submit runs to it.

    hfl-deploy global [--port 9092] [--tls DIR]                          # cloud host: Fleet gate :9092, SuperLink 127.0.0.1:9093
    hfl-deploy node --path 0.1 --parent HOST:9192 --work-dir DIR [--port 9192] ...  # each inner node's host
    hfl-deploy team --team-id 0 --global HOST:9092 --work-dir DIR ...      # = node --path 0 --parent HOST:9092
    hfl-deploy device --device-id 3 --parent HOST:9192 [--node-port 9094]  # each device
    hfl-deploy submit --superlink 127.0.0.1:9093 --output-dir /abs/out [--run-name N] [OVERRIDES...]  # on the root's host
    hfl-deploy simulate [--output-dir DIR] [OVERRIDES...]                 # `flwr run .` on a local simulation SuperLink
    hfl-deploy certs --out DIR --name HOST [--name HOST ...]               # TLS files
    hfl-deploy node-key --out DIR --name device-3                          # SuperNode auth keys
    hfl-deploy register --superlink 127.0.0.1:PORT --public-key FILE       # allow a SuperNode (on that SuperLink's host)
    hfl-deploy export-data --device-id 3 --out dev3.npz [OVERRIDES...]     # a device's own data file

Every SuperLink listens on loopback (its control port, --port + 1 unless set): Flower serves run
submission there, and a run starts code on the host. What its SuperNodes reach on --host:--port is
hfl's Fleet gate, which forwards Flower's Fleet API and refuses everything else. Submit and register
on the SuperLink's host, or through a tunnel (ssh -L 9093:127.0.0.1:9093 root-host).
``--print`` shows the commands a role runs instead of running them.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hfl.deploy import certs, roles
from hfl.deploy.control import ControlClient
from hfl.deploy.datafile import check_data_file
from hfl.deploy.private import private_dir, private_umask
from hfl.deploy.wiring import PROJECT_DIR
from hfl.errors import ConfigError, one_line, user_error


PROCESS_NAMES = {"flower-superlink": "superlink", "hfl.deploy.gate": "gate", "hfl.deploy.supernode": "supernode",
                 "hfl.deploy.runner": "runner", "hfl.deploy.device_worker": "worker"}


def process_name(command: list[str]) -> str:
    """What a role's process is: superlink, gate, supernode, runner or worker."""
    module = command[2] if command[1:2] == ["-m"] else Path(command[0]).name
    return PROCESS_NAMES.get(module, module)


def supervise(commands: list[list[str]], log_dir: Path | None = None, say=print) -> int:  # noqa: ANN001
    """Run the role's processes; when one ends (or on SIGTERM/SIGINT) stop the others. With
    ``log_dir`` each writes its output to ``<log_dir>/<name>.log`` and the console gets one line per
    change (started, ended, stopping); without, their output is the console's. They run under umask
    0077, as does every process they start (Flower's SuperExec, the ServerApp and ClientApp
    processes, hfl's node servers): what they write on this host — a SuperLink's superlink.db, node
    state, mailboxes, device data and state, these logs — is readable by its owner alone."""
    private_umask()
    env = roles.process_env()
    names = [process_name(c) for c in commands]
    if log_dir is not None:
        private_dir(log_dir)
    procs = []
    for name, command in zip(names, commands, strict=True):
        out = (Path(log_dir) / f"{name}.log").open("ab") if log_dir is not None else None
        procs.append(subprocess.Popen([roles.executable(command[0]), *command[1:]], env=env, stdout=out,
                                      stderr=subprocess.STDOUT if out else None, preexec_fn=roles.default_signals))
        if out is not None:
            out.close()  # the child holds it
            say(f"hfl-deploy: {name} started (pid {procs[-1].pid}), log {Path(log_dir) / f'{name}.log'}")

    def stop(*_: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while all(proc.poll() is None for proc in procs):
        time.sleep(0.5)
    ended = next(i for i, proc in enumerate(procs) if proc.poll() is not None)
    code = procs[ended].returncode
    if log_dir is not None:
        say(f"hfl-deploy: {names[ended]} ended (exit code {code}); stopping the role's other processes")
    stop()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
    return code


def _tls(args: argparse.Namespace) -> roles.ServerTls | None:
    return roles.ServerTls.from_dir(args.tls) if args.tls else None


def role_commands(args: argparse.Namespace) -> list[list[str]]:
    if args.command == "global":
        return roles.global_role(args.host, args.port, _tls(args), args.supernode_auth, args.database,
                                 control=args.control_port, control_host=args.control_host)
    if args.command in ("node", "team"):
        path = args.path if args.command == "node" else str(args.team_id)
        return roles.node_role(
            path, args.parent, args.work_dir, host=args.host, port=args.port,
            node_port=args.node_port, tls=_tls(args), parent_ca=args.parent_ca,
            supernode_auth=args.supernode_auth, auth_key=args.auth_key, control=args.control_port,
            control_host=args.control_host, per_message=args.per_message,
        )
    return roles.device_role(
        args.device_id, args.parent, node_port=args.node_port, state_dir=args.state_dir,
        data_path=args.data_path, node_ca=args.parent_ca, auth_key=args.auth_key, per_message=args.per_message,
    )


def default_log_dir(args: argparse.Namespace) -> Path:
    """Where a role's processes log by default: its work directory (a node), its state directory
    (a device), the current directory (the root's host), under ``logs``."""
    if args.command in ("node", "team"):
        return Path(args.work_dir) / "logs"
    if args.command == "device":
        return Path(args.state_dir or roles.DEFAULT_STATE_DIR) / "logs"
    return Path("logs")


def submit(args: argparse.Namespace) -> int:
    from hfl.config.compose import (
        compose_config,  # validates the overrides here, before anything is sent
    )

    overrides = list(args.overrides)
    if not any(o.startswith("runtime=") for o in overrides):
        overrides.insert(0, "runtime=deployment")
    from hfl.runtime.build import check_tree, federation_for

    cfg = compose_config(shlex.join(overrides), 0)
    check_tree(cfg, federation_for(cfg).tree)  # what the algorithm and the tree allow, before anything is sent
    output_dir = Path(args.output_dir)
    if not output_dir.is_absolute():
        raise SystemExit("hfl-deploy submit: --output-dir must be absolute (it is a path on the global host)")
    from hfl.deploy.submit import COMPLETED, RoundsShown, see_through

    run_name = args.run_name or time.strftime("%Y-%m-%d_%H-%M-%S")
    from hfl.output.paths import confined_name, run_dir

    run_dir({"output-dir": str(output_dir), "run-name": confined_name("--run-name", run_name)}, run_name)  # as the root checks them
    with tempfile.TemporaryDirectory(prefix="hfl-submit-") as home:
        link = ControlClient(args.superlink, args.root_certificates or "", Path(home), Path(args.app_dir))
        run_config = {"tier": "global", "overrides": shlex.join(overrides), "output-dir": str(output_dir),
                      "run-name": run_name, "state-key": experiment_key(output_dir / run_name)}
        if args.no_wait:
            run_id = link.submit(run_config, Path(home) / "run-config.toml")
            print(f"hfl-deploy: run {run_id} submitted; outputs on the global host in {output_dir / run_name}",
                  flush=True)
            return 0
        say = lambda line: print(line, flush=True)  # noqa: E731
        status = see_through(link, run_config, Path(home) / "run-config.toml", args.timeout, args.restarts,
                             args.reconnect_seconds, say=say,
                             rounds=RoundsShown(output_dir / run_name, int(cfg["global_rounds"]), say))
    if status != COMPLETED:
        print(f"hfl-deploy: to go on with the run after its last completed round: hfl-deploy submit ... "
              f"--run-name {run_name} {shlex.join([*args.overrides, 'resume=true'])}", flush=True)
    return 0 if status == COMPLETED else 1


def experiment_key(run_dir: Path) -> str:
    """What names the experiment on every host (their state folders): the same for a run
    submitted again to resume, whatever Flower's run id."""
    return f"run-{run_dir.name}-{hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hfl-deploy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("global", help="the global SuperLink (the root's host)")
    n = sub.add_parser("node", help="an inner node's host at any level: its SuperLink and its bridge SuperNode")
    t = sub.add_parser("team", help="the host of level-1 node N (= node --path N)")
    d = sub.add_parser("device", help="a device SuperNode")
    for role in (g, n, t, d):
        role.add_argument("--print", action="store_true", help="print the commands instead of running them")
        role.add_argument("--log-dir", help="where each process of the role logs (<name>.log; default: logs/ in the "
                                            "node's work dir, the device's state dir, or here); - for the console")
    for link, port in ((g, roles.GLOBAL_PORT), (n, roles.INNER_PORT), (t, roles.INNER_PORT)):
        link.add_argument("--host", default="0.0.0.0", help="address the Fleet gate binds (what SuperNodes reach)")
        link.add_argument("--port", type=int, default=port, help="the Fleet gate's port (Flower's Fleet API only)")
        link.add_argument("--control-port", type=int, help="the SuperLink's own port, where runs are submitted "
                                                           "(default: --port + 1)")
        link.add_argument("--control-host", default=roles.LOOPBACK,
                          help="address the SuperLink itself binds (default loopback: whoever reaches it can run "
                               "code on this host)")
        link.add_argument("--tls", help="directory with ca.crt, server.pem, server.key (else insecure)")
        link.add_argument("--supernode-auth", action="store_true", help="only registered SuperNodes may connect")
    g.add_argument("--database", help="the SuperLink's state file (SQLite): started again on it, the SuperLink "
                                      "knows its SuperNodes (default: in memory)")
    n.add_argument("--path", required=True, help="the node's path in the topology, e.g. 0.1")
    t.add_argument("--team-id", type=int, required=True)
    d.add_argument("--device-id", type=int, required=True)
    d.add_argument("--state-dir", help="where the device keeps its personalized model")
    d.add_argument("--data-path", help="the device's own data (npz) instead of a partition")
    for host, parent in ((n, "--parent"), (t, "--global"), (d, "--team")):
        names = [parent] if parent == "--parent" else ["--parent", parent]
        host.add_argument(*names, dest="parent", required=True, help="the parent's SuperLink HOST:PORT")
        host.add_argument("--parent-ca", *(["--global-ca"] if host is t else ["--team-ca"] if host is d else []),
                          dest="parent_ca", help="the parent SuperLink's CA certificate (TLS)")
        host.add_argument("--node-port", type=int, default=roles.NODE_PORT, help="the SuperNode's local API port")
        host.add_argument("--auth-key", help="the SuperNode's private key (SuperLink with --supernode-auth)")
        host.add_argument("--per-message", action="store_true",
                          help="Flower's own ClientApp process per message instead of the host's warm runner "
                               "(hfl.deploy.runner; also the fallback on a Flower the runner was not written for)")
    for host in (n, t):
        host.add_argument("--work-dir", required=True, help="the node's state, mailbox and FLWR_HOME")

    s = sub.add_parser("submit", help="run an experiment on a running deployment")
    s.add_argument("--superlink", default=f"{roles.LOOPBACK}:{roles.control_port(roles.GLOBAL_PORT)}",
                   help="the global SuperLink's own address, where runs are submitted (default: this host's "
                        "127.0.0.1:9093, as hfl-deploy global starts it; from elsewhere, through a tunnel)")
    s.add_argument("--root-certificates", help="its CA certificate (TLS)")
    s.add_argument("--output-dir", required=True, help="absolute path on the global host")
    s.add_argument("--app-dir", default=str(PROJECT_DIR), help="the Flower app (this project)")
    s.add_argument("--timeout", type=float, default=7 * 24 * 3600)
    s.add_argument("--no-wait", action="store_true")
    s.add_argument("--run-name", help="the run's folder under --output-dir (default: the time); with resume=true, "
                                      "the run to go on with")
    s.add_argument("--restarts", type=int, default=3,
                   help="how many times a run lost with the root's ServerApp or SuperLink is submitted again, resuming")
    s.add_argument("--reconnect-seconds", type=float, default=600.0,
                   help="how long to wait for a global SuperLink that does not answer")
    s.add_argument("overrides", nargs="*", help="Hydra overrides, as for hfl-simulate")

    m = sub.add_parser("simulate", help="`flwr run .` on a local simulation SuperLink, in one command")
    m.add_argument("--output-dir", default="outputs/flwr", help="where the run's outputs go (made absolute)")
    m.add_argument("--app-dir", default=str(PROJECT_DIR), help="the Flower app (this project)")
    m.add_argument("--work-dir", help="keep the SuperLink's log and FLWR_HOME here (default: a temporary folder)")
    m.add_argument("--timeout", type=float, default=7 * 24 * 3600)
    m.add_argument("overrides", nargs="*", help="Hydra overrides, as for hfl-simulate")

    c = sub.add_parser("certs", help="a CA and a server certificate for SuperLinks")
    c.add_argument("--out", required=True)
    c.add_argument("--name", action="append", default=[], help="a host name or IP the SuperLinks are reached by")
    c.add_argument("--replace-ca", action="store_true",
                   help="replace the CA and server files already in --out (every SuperNode must get the new ca.crt)")
    c.add_argument("--keep-existing", action="store_true",
                   help="--out already holds all four files: leave them as they are (a certs step run again)")
    k = sub.add_parser("node-key", help="a SuperNode authentication key pair")
    k.add_argument("--out", required=True)
    k.add_argument("--name", required=True)
    e = sub.add_parser("export-data", help="write one device's partition as a data file (npz) for data-path")
    e.add_argument("--device-id", type=int, required=True)
    e.add_argument("--out", required=True)
    e.add_argument("overrides", nargs="*", help="Hydra overrides describing the federation")
    r = sub.add_parser("register", help="register a SuperNode's public key with a SuperLink")
    r.add_argument("--superlink", required=True)
    r.add_argument("--root-certificates")
    r.add_argument("--public-key", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command in ("global", "node", "team", "device"):
            if args.command == "device" and args.data_path:
                check_data_file(args.data_path)  # before its SuperNode connects
            commands = role_commands(args)
            if args.print:
                print("\n".join(shlex.join(c) for c in commands))
                return 0
            if args.command in ("node", "team"):
                private_dir(args.work_dir)  # its SuperLink's database is there
            return supervise(commands, None if args.log_dir == "-" else Path(args.log_dir or default_log_dir(args)))
        if args.command == "submit":
            return submit(args)
        if args.command == "simulate":
            from hfl.deploy.flwr_run import simulate

            work = Path(args.work_dir).resolve() if args.work_dir else None
            if work is not None:
                work.mkdir(parents=True, exist_ok=True)
            status = simulate(list(args.overrides), Path(args.output_dir), Path(args.app_dir), args.timeout, work)
            print(f"hfl-deploy simulate: {status}", flush=True)
            return 0 if status == "finished:completed" else 1
        if args.command == "certs":
            existing = [Path(args.out) / name for name in certs.TLS_FILES.values()]
            if args.keep_existing and all(p.is_file() and not p.is_symlink() for p in existing):
                print("\n".join(str(p) for p in existing))  # a compose file's certs service, run again
                return 0
            paths = certs.make_tls(args.out, args.name or ["localhost"], replace_ca=args.replace_ca)
            print("\n".join(str(p) for p in paths.values()))
            return 0
        if args.command == "export-data":
            from hfl.config.compose import compose_config
            from hfl.deploy.device import export_device_data

            export_device_data(compose_config(shlex.join(args.overrides), 0), args.device_id, args.out)
            print(args.out)
            return 0
        if args.command == "node-key":
            print("\n".join(str(p) for p in certs.make_node_key(args.out, args.name)))
            return 0
        with tempfile.TemporaryDirectory(prefix="hfl-register-") as home:
            ControlClient(args.superlink, args.root_certificates or "", Path(home), PROJECT_DIR) \
                .register_supernode(Path(args.public_key))
        return 0
    except Exception as exc:  # noqa: BLE001 - what the user can fix is one line; a bug keeps its traceback
        line = _user_line(exc, PATH_OPTION.get(args.command))
        if line is None:
            raise
        raise SystemExit(f"hfl-deploy: {line}") from None


# The option that chose the path a command writes to, named in a file system error's line.
PATH_OPTION = {"certs": "--out", "node-key": "--out", "export-data": "--out", "node": "--work-dir",
               "team": "--work-dir", "device": "--state-dir", "simulate": "--output-dir"}


def _user_line(exc: BaseException, key: str | None = None) -> str | None:
    """One line for an error the user can fix, as hfl-simulate words them (hfl.errors.user_error:
    a bad setting, a read-only or full folder; hfl.config.schema: an unknown or mistyped key), or
    hfl-deploy's own refusals; None for anything else (a bug)."""
    from hydra.errors import CompactHydraException

    from hfl.config import schema

    line = schema.config_error(exc) or user_error(exc, key=key)
    if line is not None:
        return one_line(str(line))
    if isinstance(exc, FileNotFoundError | RuntimeError | TimeoutError | ValueError | ConfigError
                  | CompactHydraException | certs.KeyExistsError):
        return one_line(str(exc))
    return None


if __name__ == "__main__":
    sys.exit(main())
