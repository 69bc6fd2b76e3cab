"""benchmarks/reference/permfl.py's parent side (no authors' code is run here): the devices it
hands the PerMFL authors' code are hfl's own, teams included, and hfl's settings become their
main.py arguments."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "permfl.py"
SMALL = ["dataset=synthetic", "topology=random", "topology.num_teams=2", "topology.devices_per_team=3"]


@pytest.fixture(scope="module")
def ref():  # noqa: ANN201 - the script as a module
    spec = importlib.util.spec_from_file_location("reference_permfl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_payload_is_hfls_federation(ref) -> None:  # noqa: ANN001
    from hfl.data import build_federation

    cfg = ref.hfl_config([*SMALL, "algorithm=permfl", "seed=3"])
    payload = ref.reference_payload(cfg)
    fed = build_federation(cfg["dataset"], cfg["topology"], 3)
    assert payload["clients"] == list(range(6))
    assert payload["groups"] == [list(t) for t in fed.level1_devices] and sorted(sum(payload["groups"], [])) == list(range(6))
    for d in range(6):
        for split in ("train", "test"):
            x, y = getattr(fed.devices[d], f"x_{split}"), getattr(fed.devices[d], f"y_{split}")
            assert np.array_equal(payload[split][d]["x"], x.numpy().reshape(len(y), -1))
            assert np.array_equal(payload[split][d]["y"], y.numpy())
    assert payload["train"][0]["x"].dtype == np.float32 and payload["train"][0]["y"].dtype == np.int64


def test_main_arguments(ref) -> None:  # noqa: ANN001
    cfg = ref.hfl_config([*SMALL, "algorithm=permfl", "algorithm.lam=0.7", "algorithm.team_rounds=4"])
    args = ref.reference_args(cfg, "permfl", ref.reference_payload(cfg), 12)
    opts = dict(zip(args[::2], args[1::2]))
    assert opts["--algorithm"] == "PerMFL" and opts["--num_global_iters"] == "12"
    assert (opts["--lamda"], opts["--num_team_iters"], opts["--numusers"], opts["--tot_users"]) == ("0.7", "4", "3", "6")
    assert (opts["--num_teams"], opts["--p_teams"], opts["--gpu"]) == ("2", "2", "-1")
    assert float(opts["--beta"]) == cfg["algorithm"]["beta"] and float(opts["--eta"]) == cfg["algorithm"]["eta"]

    cfg = ref.hfl_config([*SMALL, "algorithm=perfedavg"])
    opts = dict(zip(*[iter(ref.reference_args(cfg, "perfedavg", ref.reference_payload(cfg), 5))] * 2))
    assert opts["--algorithm"] == "PerAvg" and opts["--numusers"] == "6"  # every device, as hfl's run
    assert float(opts["--beta"]) == cfg["algorithm"]["beta"] and opts["--local_iters"] == str(cfg["algorithm"]["local_steps"])

    cfg = ref.hfl_config([*SMALL, "algorithm=permfl", "algorithm.weighted=true"])
    with pytest.raises(SystemExit, match="uniform means"):
        ref.reference_args(cfg, "permfl", ref.reference_payload(cfg), 1)
