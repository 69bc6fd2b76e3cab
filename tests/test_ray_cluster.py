"""Runs on an existing Ray cluster (runtime.ray_address) with state every Ray node reaches
(runtime.state_dir): a real two-node Ray cluster made on this machine, team nodes on different
Ray nodes, gives the run of a fresh single-node Ray instance; and runtime.state_dir's checks."""

from __future__ import annotations

import functools
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import hfl.runtime.simulate
from hfl.errors import ConfigError
from hfl.state.resume import STATE_KEY
from hfl.runtime.simulate import cluster_state_warning, run
from hfl.state.store import StateStore
from hfl.node.root import RootStrategy
from tests.conftest import SMALL, compose_cfg

TIMING = ("seconds", "compute_seconds")  # wall clock: the only fields allowed to differ
TOLERANCE = 1e-6
# 2 teams x 3 devices of synthetic data, 3 global rounds, each evaluated; one CPU per team actor.
CLUSTER_RUN = [*SMALL, "runtime=simulation", "runtime.num_cpus_per_team=1", "eval_every=1"]
HOLD = 0.5  # seconds a team's fit keeps its actor on the cluster (see _level1_client_telling_its_ray_node)


# ---------------------------------------------------------------- helpers
def rows(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in path.read_text().splitlines()] if path.exists() else []


def final_model(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "checkpoints" / "global_model.npz") as data:
        return [data[f"arr_{i}"] for i in range(sum(n.startswith("arr_") for n in data.files))]


def stored(root: Path) -> dict[str, dict[str, np.ndarray]]:
    store = StateStore(root)
    return {p.stem: store.load(p.stem) for p in sorted(root.glob("[!.]*.npz"))}


def assert_close(got: object, want: object, where: str) -> None:
    """Equal, numbers within TOLERANCE (absolute), at any nesting."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert got == pytest.approx(want, rel=0, abs=TOLERANCE, nan_ok=True), where
    else:
        assert got == want, where


def assert_same_results(got: Path, got_state: Path, want: Path, want_state: Path) -> None:
    """The final global model, every node's and device's stored state and every metrics and
    samples row (but wall-clock fields) of two runs, within TOLERANCE."""
    for a, b in zip(final_model(got), final_model(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
    a_state, b_state = stored(got_state), stored(want_state)
    assert sorted(a_state) == sorted(b_state) and any(k.startswith("device") for k in b_state)  # devices too
    for key, arrays in b_state.items():
        assert sorted(a_state[key]) == sorted(arrays), key
        for name, value in arrays.items():
            if np.issubdtype(value.dtype, np.number):
                np.testing.assert_allclose(a_state[key][name], value, rtol=0, atol=TOLERANCE, err_msg=f"{key}/{name}")
            else:  # names, flags
                np.testing.assert_array_equal(a_state[key][name], value, err_msg=f"{key}/{name}")
    want_rows = rows(want, "metrics.jsonl")
    assert [r["round"] for r in want_rows] == [1, 2, 3]
    assert_close(rows(got, "metrics.jsonl"), want_rows, "metrics.jsonl")
    assert_close(rows(got, "samples.jsonl"), rows(want, "samples.jsonl"), "samples.jsonl")


# ---------------------------------------------------------------- a two-node Ray cluster
@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """A head and a second raylet node, one CPU each (so Flower's pool holds one 1-CPU team actor
    per Ray node), in a temp dir of their own; shut down whatever the test does."""
    import ray._common.utils
    import ray._private.utils
    from ray.cluster_utils import Cluster

    # Cluster writes (and on shutdown deletes) /tmp/ray/ray_current_cluster, which a plain
    # ray.init() of anyone else on this machine would join: keep this test's cluster to itself.
    monkeypatch.setattr(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None)
    monkeypatch.setattr(ray._common.utils, "reset_ray_address", lambda *args, **kwargs: None)
    temp_dir = Path(tempfile.mkdtemp(prefix="hflrc"))  # short: Ray's socket paths live under it
    cluster = Cluster()
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, temp_dir=str(temp_dir), include_dashboard=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _level1_client_telling_its_ray_node(cfg: dict, context):  # noqa: ANN001, ANN202
    """hfl's level-1 client (hfl.runtime.apps.level1_client), its fit replies also naming the Ray node the
    actor runs on. Runs in the actors: pickled by reference, imported there from this module.
    Each fit holds its actor for HOLD seconds more (timing only; the results are unchanged):
    Flower's simulation picks up messages every 0.1 s, so the round's other team, however late
    it is picked up, finds only the other actor free rather than reusing a finished one."""
    import time

    import ray

    from hfl.runtime.apps import level1_client

    client = level1_client(cfg, context)
    fit = client.fit

    def fit_telling_its_node(ins):  # noqa: ANN001, ANN202
        res = fit(ins)
        res.metrics["ray_node"] = ray.get_runtime_context().get_node_id()
        time.sleep(HOLD)
        return res

    client.fit = fit_telling_its_node
    return client


@pytest.mark.slow
def test_two_node_ray_cluster_equals_a_fresh_single_node_instance(ray_cluster, tmp_path, monkeypatch, caplog):
    from flwr.client import ClientApp

    nodes = {node.node_id for node in ray_cluster.list_all_nodes()}
    assert len(nodes) == 2
    # Which Ray node ran each team's fit, as the root saw the replies.
    ran_on: dict[int, dict[int, str]] = {}
    aggregate_fit = RootStrategy.aggregate_fit

    def recording(self, server_round, results, failures):  # noqa: ANN001, ANN202
        ran_on[server_round] = {int(res.metrics["level1_index"]): str(res.metrics["ray_node"]) for _, res in results}
        return aggregate_fit(self, server_round, results, failures)

    shared = tmp_path / "shared-state"  # stands for the directory every Ray node mounts
    cfg = compose_cfg(*CLUSTER_RUN, f"runtime.ray_address={ray_cluster.address}", f"runtime.state_dir={shared}")
    with monkeypatch.context() as patch:
        patch.setattr(RootStrategy, "aggregate_fit", recording)
        patch.setattr(hfl.runtime.simulate, "make_client_app",
                      lambda cfg: ClientApp(client_fn=functools.partial(_level1_client_telling_its_ray_node, cfg)))
        with caplog.at_level(logging.WARNING, logger="hfl"):
            on_cluster = run(cfg, tmp_path / "cluster")
    assert not [r for r in caplog.records if "runtime.state_dir is null" in r.getMessage()]
    # Both teams in every round, one on each Ray node: the cluster's two 1-CPU actors, one per
    # node (neither node can host both), each held by one team of the round.
    assert sorted(ran_on) == [1, 2, 3]
    for rnd, teams in ran_on.items():
        assert sorted(teams) == [0, 1], rnd
        assert set(teams.values()) == nodes, (rnd, teams)
    # The state went to the run's own folder under runtime.state_dir, none to the run directory.
    key = (tmp_path / "cluster" / STATE_KEY).read_text().strip()
    assert key.startswith("cluster-") and (shared / key).is_dir() and not (tmp_path / "cluster" / "state").exists()

    local = run(compose_cfg(*CLUSTER_RUN), tmp_path / "local")  # runtime.ray_address null: a fresh instance
    assert_same_results(tmp_path / "cluster", shared / key, tmp_path / "local", tmp_path / "local" / "state")
    assert_close({k: on_cluster[k] for k in ("rounds", "final", "best", "failures")},
                 {k: local[k] for k in ("rounds", "final", "best", "failures")}, "summary")


# ---------------------------------------------------------------- runtime.state_dir
@pytest.mark.parametrize("value", ["relative/state", "' '", "FILE", "FILE/below"])
def test_a_bad_state_dir_is_refused_naming_it(value, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    value = value.replace("FILE", str(tmp_path / "file"))
    with pytest.raises(ConfigError) as caught:
        run(compose_cfg(*SMALL, "runtime=simulation", f"runtime.state_dir={value}"), tmp_path / "run")
    assert caught.value.key == "runtime.state_dir"
    assert not (tmp_path / "run").exists()  # refused before anything was written


class Started(Exception):
    """Stands for the Ray run: the test stops where it would start."""


def test_joining_a_cluster_with_the_state_in_the_run_directory_warns(tmp_path, monkeypatch, caplog):
    state = Path("/runs/a/state")
    cluster = {"name": "simulation", "ray_address": "auto", "state_dir": None}
    warning = cluster_state_warning(cluster, state)
    assert warning is not None and "/runs/a/state" in warning and "every Ray node" in warning
    assert cluster_state_warning({**cluster, "state_dir": "/shared/hfl"}, state) is None
    for fresh in (None, "local"):  # a fresh local instance
        assert cluster_state_warning({**cluster, "ray_address": fresh}, state) is None

    def started(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise Started

    monkeypatch.setattr(hfl.runtime.simulate, "run_simulation", started)
    with caplog.at_level(logging.WARNING, logger="hfl"), pytest.raises(Started):
        run(compose_cfg(*SMALL, "runtime=simulation", "runtime.ray_address=auto"), tmp_path)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"hfl: {cluster_state_warning(cluster, tmp_path.resolve() / 'state')}"]


def test_flwr_run_keeps_each_runs_state_under_state_dir(tmp_path):
    from hfl.config.compose import compose_config  # `flwr run .`: the config from the run config's overrides

    assert compose_config(f"runtime.state_dir={tmp_path}", 7)["runtime"]["state_dir"] == str(tmp_path / "hfl-state-7")
    assert compose_config("", 7)["runtime"]["state_dir"] == str(Path(tempfile.gettempdir()) / "hfl-state-7")
