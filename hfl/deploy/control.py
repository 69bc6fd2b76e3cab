"""Flower's Control API (submit, status, stop), through the ``flwr`` CLI with a private
FLWR_HOME: the interface Flower documents and keeps stable, and the one users type."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hfl.deploy.private import private_dir
from hfl.deploy.roles import executable, flwr_home_config, toml_value

log = logging.getLogger("hfl")
CONNECTION = "hfl"
FINISHED = "finished:"


class ControlClient:
    """One SuperLink's Control API, driven through Flower's CLI with a private FLWR_HOME."""

    def __init__(self, address: str, root_certificates: str, home: Path, app_dir: Path,
                 prefix: list[str] | None = None) -> None:
        self.home = home
        self.app_dir = app_dir
        self.prefix = prefix or []  # what runs the CLI on the SuperLink's host (a network namespace in tests)
        private_dir(home)  # FLWR_HOME: Flower keeps its credentials and app copies there
        ca = str(Path(root_certificates).resolve()) if root_certificates else ""  # the CLI wants it absolute
        (home / "config.toml").write_text(flwr_home_config(CONNECTION, address, ca))

    def _cli(self, *args: str, timeout: float = 120) -> dict:
        env = {**os.environ, "FLWR_HOME": str(self.home)}
        proc = subprocess.run([*self.prefix, executable("flwr"), *args, "--format", "json"], capture_output=True, text=True,
                              env=env, timeout=timeout, check=False)
        try:
            reply = json.loads(proc.stdout)
        except json.JSONDecodeError:
            reply = {"success": False, "error-message": (proc.stdout + proc.stderr).strip()[-2000:]}
        if not reply.get("success"):
            raise RuntimeError(f"flwr {args[0]} failed: {reply.get('error-message', reply)}")
        return reply

    def submit(self, run_config: Mapping[str, object], config_file: Path,
               federation_config: Mapping[str, object] | None = None) -> int:
        config_file.write_text("".join(f"{key} = {toml_value(v)}\n" for key, v in run_config.items()))
        extra = []
        if federation_config:  # e.g. a simulation SuperLink's num-supernodes
            extra = ["--federation-config", " ".join(f"{k}={toml_value(v)}" for k, v in federation_config.items())]
        return int(self._cli("run", str(self.app_dir), CONNECTION, "--run-config", str(config_file), *extra)["run-id"])

    def status(self, run_id: int) -> str:
        return self.run_info(run_id)[0]

    def run_info(self, run_id: int) -> tuple[str, str]:
        """The run's status and Flower's details of it; LookupError if the SuperLink does not
        know the run, RuntimeError if it does not answer."""
        try:
            run = self._cli("ls", CONNECTION, "--run-id", str(run_id))["runs"][0]
        except RuntimeError as exc:
            if "not found" in str(exc):
                raise LookupError(str(exc)) from exc
            raise
        return str(run["status"]), str(run.get("status-details", ""))

    def stop(self, run_id: int) -> None:
        try:
            self._cli("stop", str(run_id), CONNECTION)
        except RuntimeError as exc:
            log.warning("could not stop run %d: %s", run_id, exc)

    def wait(self, run_id: int, timeout: float, poll: float = 10.0,
             done: Callable[[], bool] = lambda: False) -> str:
        """The run's final status; stops the run and raises if it outlives ``timeout``.

        Each status query starts a CLI process (about a CPU-second here), so a cheap
        ``done`` check (say, a result file) is polled often and the status only every
        ``poll`` seconds, or every second once ``done`` holds."""
        deadline = time.monotonic() + timeout
        next_query = time.monotonic()
        while True:
            if done() or time.monotonic() >= next_query:
                status = self.status(run_id)
                if status.startswith(FINISHED):
                    return status
                next_query = time.monotonic() + (1.0 if done() else poll)
            if time.monotonic() > deadline:
                self.stop(run_id)
                raise TimeoutError(f"run {run_id} still running after {timeout:.0f} s; stopped it")
            time.sleep(0.25)

    def register_supernode(self, public_key: Path) -> None:
        """Allow the SuperNode holding this key (SuperLink started with --enable-supernode-auth)."""
        self._cli("supernode", "register", str(public_key), CONNECTION)
