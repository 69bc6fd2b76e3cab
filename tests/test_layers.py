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


def lint() -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_the_layers_contract_holds():
    code, out = lint()
    assert "Contracts: " in out, out  # the contract was read and checked
    broken = set(re.findall(r"^- (\S+) -> (\S+) \(l\.\d+\)", out, flags=re.M))
    assert not broken, f"imports that break docs/architecture.md's layers:\n{out}"
    assert code == 0, out
