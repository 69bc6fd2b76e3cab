"""The Flower app bundle (FAB) a deployment installs on every host carries every module and config
file of hfl: Flower's builder leaves out what its own patterns exclude (``**/*_test.py``,
``**/test_*.py``), so a module named like a test would be missing on the hosts and every run
importing it would fail there (``hfl/rules/fit_test.py`` did: FedAvg and PFLEGO deployments)."""

from __future__ import annotations

import io
import subprocess
import zipfile
from pathlib import Path

from flwr.cli.build import build_fab_from_disk

ROOT = Path(__file__).resolve().parents[1]


def test_the_bundle_flower_builds_holds_every_tracked_module_and_config_file():
    tracked = subprocess.run(["git", "ls-files", "hfl", "clients", "strategies", "conf"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    wanted = {path for path in tracked if path.endswith((".py", ".yaml"))}
    assert "hfl/rules/fit_testing.py" in wanted and len(wanted) > 100
    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))) as fab:
        bundled = set(fab.namelist())
    assert sorted(wanted - bundled) == []
