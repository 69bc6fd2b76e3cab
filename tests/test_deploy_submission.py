"""Run submission is the operator's alone: a Flower app submitted with a plain ``flwr run`` from
another host (its own network namespace, the address a device host has) is refused at the Fleet
gate and cannot reach the SuperLink itself, while a device SuperNode on that same host joins
through the gate, and the same app submitted on the root's own host runs (so the app is real code
that would have run). Real processes, as ``hfl-deploy global`` and ``hfl-deploy device`` start them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfl.deploy import roles
from hfl.deploy.loopback import Deployment
from hfl.deploy.netns import available as why_no_netns
from hfl.tree.shape import from_teams

pytestmark = pytest.mark.deployment

FOREIGN_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "foreignapp"
version = "1.0.0"
description = "not the operator's"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "someone"

[tool.flwr.app.components]
serverapp = "foreign:app"
clientapp = "foreign:client"

[tool.flwr.app.config]
marker = "unset"
"""

FOREIGN_APP = """from pathlib import Path

from flwr.client import ClientApp
from flwr.server import ServerApp

app = ServerApp()
client = ClientApp()


@app.main()
def main(grid, context) -> None:
    Path(str(context.run_config["marker"])).write_text("ran on this host")
"""


def flwr(dep: Deployment, host: str, home: Path, address: str, *args: str) -> dict:
    """Flower's own CLI on ``host`` against ``address``, as anyone there would type it."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(roles.flwr_home_config("target", address, None))
    flwr_cli = str(Path(sys.executable).parent / "flwr")
    done = subprocess.run([*dep.on_host(host), flwr_cli, *args, "--format", "json"], capture_output=True, text=True,
                          env={**os.environ, "FLWR_HOME": str(home)}, timeout=120, check=False)
    return json.loads(done.stdout)


def test_a_foreign_app_is_refused_from_another_host_and_runs_only_from_the_roots_own(tmp_path: Path) -> None:
    if why_no_netns() is not None:
        pytest.skip(why_no_netns())
    app = tmp_path / "foreign"
    app.mkdir()
    (app / "pyproject.toml").write_text(FOREIGN_PYPROJECT)
    (app / "foreign.py").write_text(FOREIGN_APP)
    marker = tmp_path / "ran"
    config = ["--run-config", f'marker="{marker}"']
    dep = Deployment(tmp_path / "deploy", from_teams([[0]]), netns=True)
    dep.root.mkdir()
    try:
        dep.start_global()
        gate = dep.global_address                                                 # what devices reach
        behind = f"{dep.address('global')}:{dep.ports['control-global']}"       # the SuperLink's own port
        outsider = "device0"
        refused = flwr(dep, outsider, tmp_path / "h1", gate, "run", str(app), "target", *config)
        assert refused["success"] is False and "403 Forbidden" in refused["error-message"]
        unreachable = flwr(dep, outsider, tmp_path / "h2", behind, "run", str(app), "target", *config)
        assert unreachable["success"] is False  # nothing listens there beyond the root host's loopback
        listed = flwr(dep, outsider, tmp_path / "h3", gate, "ls", "target")
        assert listed["success"] is False and "403 Forbidden" in listed["error-message"]

        # The Fleet API from the same host: a device SuperNode joins the root's SuperLink through the gate.
        device, worker = roles.device_role(0, gate, node_port=dep.ports["device0"], state_dir=tmp_path / "state")
        dep.start_process("device0", device)
        dep.start_process("worker0", worker)
        deadline = time.monotonic() + 60
        while True:
            nodes = flwr(dep, "global", tmp_path / "h4", dep.control_address(), "supernode", "ls", "target")["nodes"]
            if [n["status"] for n in nodes] == ["online"]:
                break
            assert time.monotonic() < deadline, f"the device did not join through the gate: {nodes}\n{dep.logs()}"
            time.sleep(1)
        assert flwr(dep, "global", tmp_path / "h4", dep.control_address(), "ls", "target")["runs"] == []
        assert not marker.exists()

        # The operator, on the root's host: the same app is accepted and runs - it was real code.
        accepted = flwr(dep, "global", tmp_path / "h5", dep.control_address(), "run", str(app), "target", *config)
        assert accepted["success"] is True, accepted
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline, dep.logs()
            time.sleep(0.5)
        gate_log = (dep.root / "gate-global.log").read_text()
        assert gate_log.count("refused POST /v1/control/") == 2 and "/v1/control/start-run" in gate_log
    finally:
        dep.stop()
