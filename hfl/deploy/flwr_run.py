"""``flwr run .`` in one command (``hfl-deploy simulate``): the app run by Flower's own CLI on a
local simulation SuperLink, with Flower's five steps done for the user — a private FLWR_HOME, a
SuperLink started with ``--simulation --disable-runtime-dependency-installation`` (Flower's managed
local SuperLink would reinstall the app's dependencies for every run), a connection naming it,
``flwr run . <connection> --federation-config num-supernodes=<level-1 nodes>`` with the Hydra
overrides as the run config, and the run's final status, after which the SuperLink is stopped."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hfl.deploy import roles
from hfl.deploy.control import ControlClient
from hfl.deploy.loopback import free_ports, wait_port

log = logging.getLogger("hfl")


def simulate(overrides: list[str], output_dir: Path, app_dir: Path, timeout: float, work_dir: Path | None = None,
             say: Callable[[str], None] = print) -> str:
    """Run the experiment ``overrides`` describe with ``flwr run`` on a fresh local simulation
    SuperLink, saying its rounds as they end and then its summary and where its outputs are;
    returns the run's final status (``finished:completed`` when it succeeded). The overrides are
    checked here first, so a bad one fails before any process starts."""
    from hfl.deploy.submit import RoundsShown
    from hfl.config.compose import compose_config
    from hfl.runtime.build import federation_for

    if any(o.startswith("runtime=") and o != "runtime=simulation" for o in overrides):
        raise RuntimeError("hfl-deploy simulate runs Flower's simulation runtime; drop the runtime= override")
    cfg = compose_config(shlex.join(overrides), 0)
    supernodes = len(federation_for(cfg).tree.children(""))
    with tempfile.TemporaryDirectory(prefix="hfl-flwr-") as tmp:
        work = Path(work_dir or tmp)
        home = work / "flwr-home"
        (port,) = free_ports(1)
        command = ["flower-superlink", "--insecure", "--simulation", "--disable-runtime-dependency-installation",
                   "--host", "127.0.0.1", "--port", str(port)]
        with (work / "superlink.log").open("ab") as out:
            superlink = subprocess.Popen([roles.executable(command[0]), *command[1:]], stdout=out,
                                         stderr=subprocess.STDOUT, cwd=work,
                                         env=roles.process_env(FLWR_HOME=str(home)), start_new_session=True,
                                         preexec_fn=roles.default_signals)
        try:
            wait_port(port, timeout=60)
            link = ControlClient(f"127.0.0.1:{port}", "", home, app_dir)
            run_name = time.strftime("%Y-%m-%d_%H-%M-%S")
            run_config = {"overrides": shlex.join(overrides), "output-dir": str(output_dir.resolve()),
                          "run-name": run_name}
            run_id = link.submit(run_config, work / "run-config.toml",
                                 federation_config={"num-supernodes": supernodes})
            say(f"hfl-deploy simulate: run {run_id} on {supernodes} SuperNodes; outputs in "
                f"{output_dir.resolve() / run_name}")
            rounds = RoundsShown(output_dir.resolve() / run_name, int(cfg["global_rounds"]), say)
            status = link.wait(run_id, timeout, poll=2.0, done=lambda: rounds.poll() or False)
            rounds.finish(status)
            return status
        finally:
            if superlink.poll() is None:
                os.killpg(superlink.pid, signal.SIGTERM)
                try:
                    superlink.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(superlink.pid, signal.SIGKILL)
