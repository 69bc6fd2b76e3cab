"""Hosts of their own on one Linux machine: a network namespace per host, each with one address on
a bridge in the root namespace (``ip netns`` and veth pairs; needs root). A process started with
``prefix(host)`` sees only its host's interfaces: its loopback is its own, and it reaches the other
hosts at their addresses, as on a real network. The root namespace (the test, a fault proxy) is
on the bridge at ``gateway``."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    probe = f"hflprobe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Namespaces:
    """``hosts`` (names) each in a namespace ``hfl<tag>-<i>`` with address 10.<net>.<i // 250>.<i % 250 + 2>/16."""

    def __init__(self, hosts: list[str]) -> None:
        self.tag = secrets.token_hex(2)
        self.net = 100 + secrets.randbelow(100)  # 10.100-199.0.0/16: away from usual private ranges
        self.hosts = {name: i for i, name in enumerate(hosts)}
        self.bridge = f"hflbr{self.tag}"
        self.gateway = f"10.{self.net}.255.254"
        self.made: list[str] = []

    def ns(self, host: str) -> str:
        return f"hfl{self.tag}-{self.hosts[host]}"

    def ip(self, host: str) -> str:
        i = self.hosts[host]
        return f"10.{self.net}.{i // 250}.{i % 250 + 2}"

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append("bridge")
        _ip("addr", "add", f"{self.gateway}/16", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host, i in self.hosts.items():
            ns, outer = self.ns(host), f"hv{self.tag}{i}"
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(host)}/16", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def delete(self) -> None:
        """Every namespace (its veth goes with it) and the bridge."""
        for made in reversed(self.made):
            if made == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
            else:
                subprocess.run(["ip", "netns", "del", made], capture_output=True, check=False)
        self.made.clear()
