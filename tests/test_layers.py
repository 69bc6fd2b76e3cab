"""hfl's layers (docs/architecture.md, "Layers"): import-linter's contract in pyproject.toml
([tool.importlinter], no ignored imports) holds: a module imports only from its own layer and
those below it, directly or through others."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")

# Imports that break the layers from files being rewritten under issue 47 item 1 (the root's
# driver), moved with that work: node/inprocess.py takes Lockstep from hfl.node, and the wire
# format (hfl/node/payload.py) and DroppedProxy (hfl/node/faults.py) go below the protocol.
# The test fails on any other import that breaks a layer, and once one of these is gone (then
# delete it here: the set ends empty, and with it this exemption).
PENDING = {
    ("hfl.node.inprocess", "hfl.accel.lockstep"),
    ("hfl.algorithm", "hfl.node.payload"),
    ("hfl.clock.timer", "hfl.node.payload"),
    ("hfl.clock.timer", "hfl.node.faults"),
}


def lint() -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_the_layers_contract_holds():
    code, out = lint()
    assert "Contracts: " in out, out  # the contract was read and checked
    broken = set(re.findall(r"^- (\S+) -> (\S+) \(l\.\d+\)", out, flags=re.M))
    assert not broken - PENDING, f"imports that break docs/architecture.md's layers:\n{out}"
    assert broken == PENDING, f"no longer broken (delete them from PENDING): {sorted(PENDING - broken)}"
    assert (code == 0) == (not broken), out
