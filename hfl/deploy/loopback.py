"""A whole deployment on one host's loopback ports, for tests and benchmarks: the root's SuperLink
and its Fleet gate, a host per inner node of the tree (SuperLink + gate + bridge SuperNode each), a
SuperNode per device, and
fault-injecting proxies on the links chosen (``fault_proxy``). Every process
is started with the role command lines of ``hfl.deploy.roles`` (what ``hfl-deploy`` runs),
logs to ``root/<name>.log``, and is stopped by pid (its whole process group)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hfl.deploy import roles
from hfl.deploy.certs import make_node_key
from hfl.deploy.control import ControlClient
from hfl.deploy.faultproxy import FaultProxy
from hfl.deploy.netns import Namespaces
from hfl.tree.shape import Tree, parent_of


def free_ports(count: int) -> list[int]:
    socks, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def wait_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


@dataclass
class Deployment:
    root: Path
    tree: Tree                        # the topology: a host per inner node, a SuperNode per device
    tls: roles.ServerTls | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    proxies: dict[str, FaultProxy] = field(default_factory=dict)  # node path -> the proxy on its bridge's link
    commands: dict[str, list[str]] = field(default_factory=dict)  # process name -> its last command line
    netns: bool = False  # each host in a network namespace of its own, with its own address (hfl.deploy.netns)
    auth: bool = False  # SuperNode authentication on every SuperLink, every SuperNode's key registered first
    per_message: bool = False  # Flower's process per message on every host instead of its runner (hfl.deploy.runner)

    def __post_init__(self) -> None:
        self.inner = self.tree.inner_paths
        # "global"/"link-P": the Fleet gates children reach; "control-global"/"control-P": the
        # SuperLinks themselves, on their hosts' loopback (hfl.deploy.gate).
        names = ["global", "control-global"] + [f"link-{p}" for p in self.inner] + \
            [f"control-{p}" for p in self.inner] + [f"bridge-{p}" for p in self.inner] + \
            [f"device{d}" for d in self.tree.devices_under("")]
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.hosts = None
        if self.netns:
            self.hosts = Namespaces(["global", *[f"node-{p}" for p in self.inner],
                                     *[f"device{d}" for d in self.tree.devices_under("")]])
            self.hosts.create()  # before anything is started, so that a proxy can listen on the bridge

    def host_of(self, name: str) -> str | None:
        """The host a process runs on: global, node-P (its SuperLink and its bridge) or deviceD."""
        if name in ("global", "gate-global") or name.startswith("device"):
            return "global" if name == "gate-global" else name
        if name.startswith("worker"):
            return f"device{name[len('worker'):]}"
        if name.startswith(("link-", "bridge-", "gate-", "runner-")):
            return f"node-{name.split('-', 1)[1]}"
        return None

    def address(self, host: str) -> str:
        """Where other hosts reach ``host``."""
        return self.hosts.ip(host) if self.hosts is not None else "127.0.0.1"

    @property
    def bind(self) -> str:
        """What a Fleet gate binds: its host's every address under namespaces (its address on the
        bridge), loopback otherwise. The SuperLinks themselves are on loopback either way."""
        return "0.0.0.0" if self.hosts is not None else "127.0.0.1"

    def on_host(self, host: str) -> list[str]:
        """The prefix that runs a command on ``host`` (its namespace; nothing without namespaces)."""
        return self.hosts.prefix(host) if self.hosts is not None else []

    def control_address(self, path: str = "") -> str:
        """Where runs are submitted to node ``path``'s SuperLink ("" = the root's): its host's
        loopback, so a command using it runs there (``on_host``)."""
        return f"{roles.LOOPBACK}:{self.ports['control-global' if path == '' else f'control-{path}']}"

    def host_of_node(self, path: str) -> str:
        return "global" if path == "" else f"node-{path}"

    def start_process(self, name: str, command: list[str]) -> None:
        log = (self.root / f"{name}.log").open("ab")
        env = roles.process_env(FLWR_HOME=str(self.root / "flwr-home"))
        self.commands[name] = list(command)
        host = self.host_of(name)
        prefix = self.hosts.prefix(host) if self.hosts is not None and host is not None else []
        self.procs[name] = subprocess.Popen([*prefix, roles.executable(command[0]), *command[1:]], stdout=log,
                                            stderr=subprocess.STDOUT, cwd=self.root, env=env, start_new_session=True,
                                            preexec_fn=roles.default_signals)

    @property
    def global_address(self) -> str:
        return f"{self.address('global')}:{self.ports['global']}"

    def link_of(self, path: str) -> str:
        """The SuperLink the children of ``path`` connect to ("" = the root's)."""
        return self.global_address if path == "" else f"{self.address(f'node-{path}')}:{self.ports[f'link-{path}']}"

    def auth_key(self, name: str, parent: str) -> Path | None:
        """With ``auth``: SuperNode ``name``'s private key, its public key registered with the
        SuperLink of node ``parent`` it connects to (Flower's ``flwr supernode register``, on that
        SuperLink's host) the first time."""
        if not self.auth:
            return None
        private = self.root / "keys" / name
        if not private.exists():
            private, public = make_node_key(self.root / "keys", name)
            home = self.root / "control" / name
            link = ControlClient(self.control_address(parent), str(self.tls.ca) if self.tls else "", home, home,
                                 prefix=self.on_host(self.host_of_node(parent)))
            link.register_supernode(public)
        return private

    def start_device(self, device_id: int) -> None:
        lowest = next(p for p in self.tree.nodes_at(self.tree.depth - 1) if device_id in self.tree.devices(p))
        cmd, worker = roles.device_role(
            device_id, self.link_of(lowest), node_port=self.ports[f"device{device_id}"],
            state_dir=self.root / f"device{device_id}-state", node_ca=self.tls.ca if self.tls else None,
            auth_key=self.auth_key(f"device{device_id}", lowest), per_message=self.per_message,
        )
        self.start_process(f"device{device_id}", cmd)
        running = self.procs.get(f"worker{device_id}")
        if running is None or running.poll() is not None:  # the host's runner or worker (hfl.deploy.roles.device_role)
            self.start_process(f"worker{device_id}", worker)

    def fault_proxy(self, path: str, delay: float = 0.0) -> FaultProxy:
        """Put a fault-injecting proxy (hfl.deploy.faultproxy) on the link from node ``path``'s
        bridge to its parent's SuperLink; call it before ``start``."""
        (port,) = free_ports(1)
        parent_host, parent_port = self.link_of(parent_of(path)).rsplit(":", 1)
        listen = self.hosts.gateway if self.hosts is not None else "127.0.0.1"
        proxy = FaultProxy(port, parent_host, int(parent_port), delay=delay, host=listen)
        proxy.start()
        self.proxies[path] = proxy
        return proxy

    def start_node(self, path: str, parts: tuple[str, ...] = ("link", "bridge")) -> None:
        """The host of inner node ``path``: its SuperLink (with its gate, unless that still runs) and
        its bridge (or one of them again)."""
        parent = (":".join(map(str, self.proxies[path].listen)) if path in self.proxies
                  else self.link_of(parent_of(path)))
        link, gate, bridge, *runner = roles.node_role(
            path, parent, self.root / f"node-{path}-work", host=self.bind,
            port=self.ports[f"link-{path}"], node_port=self.ports[f"bridge-{path}"], tls=self.tls,
            parent_ca=self.tls.ca if self.tls else None, supernode_auth=self.auth,
            auth_key=self.auth_key(f"bridge-{path}", parent_of(path)) if "bridge" in parts else None,
            control=self.ports[f"control-{path}"], per_message=self.per_message,
        )
        (self.root / f"node-{path}-work").mkdir(exist_ok=True)
        if "link" in parts:
            self.start_process(f"link-{path}", link)
            self._start_gate(f"gate-{path}", gate, self.ports[f"link-{path}"], self.address(f"node-{path}"))
        if "bridge" in parts:
            self.start_process(f"bridge-{path}", bridge)
            running = self.procs.get(f"runner-{path}")
            if runner and (running is None or running.poll() is not None):  # the bridge's runner (hfl.deploy.runner)
                self.start_process(f"runner-{path}", runner[0])

    def start_global(self) -> None:
        """The root's SuperLink, its state in a file (it can be started again), and its gate."""
        glob, gate = roles.global_role(self.bind, self.ports["global"], self.tls, supernode_auth=self.auth,
                                       database=self.root / "global.db", control=self.ports["control-global"])
        self.start_process("global", glob)
        self._start_gate("gate-global", gate, self.ports["global"], self.address("global"))

    def _start_gate(self, name: str, command: list[str], port: int, address: str) -> None:
        """A gate, unless it still runs (it outlives a restarted SuperLink), and its SuperLink up."""
        running = self.procs.get(name)
        if running is None or running.poll() is not None:
            self.start_process(name, command)
        wait_port(port, host=address)
        control = int(command[command.index("--upstream") + 1].rsplit(":", 1)[1])
        self.wait_control(control, name)

    def wait_control(self, port: int, name: str, timeout: float = 30.0) -> None:
        """Until the SuperLink behind gate ``name`` listens on its host's loopback."""
        host = self.host_of(name)
        if self.hosts is None or host is None:
            wait_port(port, timeout)
            return
        probe = ("import socket, sys, time\n"
                 "end = time.monotonic() + float(sys.argv[2])\n"
                 "while time.monotonic() < end:\n"
                 "    try:\n"
                 "        socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1).close()\n"
                 "        sys.exit(0)\n"
                 "    except OSError:\n"
                 "        time.sleep(0.2)\n"
                 "sys.exit(1)\n")
        done = subprocess.run([*self.on_host(host), sys.executable, "-c", probe, str(port), str(timeout)], check=False)
        if done.returncode:
            raise TimeoutError(f"nothing listens on {host}'s 127.0.0.1:{port} after {timeout} s")

    def start(self) -> None:
        self.start_global()
        for path in self.inner:
            self.start_node(path)
        for d in self.tree.devices_under(""):
            self.start_device(d)

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash: no goodbye to the SuperLink."""
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        if self.hosts is not None:
            self.hosts.delete()

    def submit_command(self, output_dir: Path, *args: str) -> list[str]:
        """``hfl-deploy submit`` as an operator runs it: on the root's host, to its SuperLink's loopback port."""
        cmd = [*self.on_host("global"), sys.executable, "-m", "hfl.deploy.cli", "submit", "--superlink",
               self.control_address(), "--output-dir", str(output_dir)]
        if self.tls:
            cmd += ["--root-certificates", str(self.tls.ca)]
        return [*cmd, *args]

    def submit(self, overrides: list[str], output_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
        cmd = self.submit_command(output_dir, "--timeout", str(timeout), *overrides)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, check=False)

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.root.glob("*.log")))
