"""Resume a killed ``hfl-simulate`` run from its last completed global round.

``hfl-simulate <the run's overrides> resume=true hydra.run.dir=<its directory>`` ends with the
same models and the same metrics.jsonl (but for wall-clock fields) as a run never interrupted:

- at its start a run records its config (``checkpoints/config.json``); a resumption refuses a
  different one, naming the keys (those in ``FREE_KEYS`` may differ);
- at the end of every global round (after its evaluation, or after its fit when the round is
  not evaluated) the recorder writes ``checkpoints/resume.pkl``: the round and the recorder's
  state (hfl.output.recorder);
- every node, the root included (hfl.node.root), and every device keeps its state in the versioned
  store (hfl.state.store): before anything
  runs, a resumption rolls it back to the checkpoint's round R, whatever round R+1 wrote, and the
  recorder rewrites metrics.jsonl and samples.jsonl up to round R;
- Flower counts rounds from 1: the remaining T - R rounds run behind ``Resumed``, which shows
  the strategy the true global rounds (FitIns ``global_round`` and the round paths included,
  so every seeded stream — sampling, device draws, FeMAM's K-means — is the one of those rounds).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.common import Parameters, ndarrays_to_parameters
from flwr.server.strategy import Strategy

from hfl.errors import ConfigError
from hfl.state.store import StateStore, atomic_write_bytes

log = logging.getLogger("hfl")

CHECKPOINT = Path("checkpoints") / "resume.pkl"
CONFIG = Path("checkpoints") / "config.json"
# The run's folder under runtime.state_dir (absent when the run keeps its state in <run dir>/state).
STATE_KEY = Path("checkpoints") / "state_key"
# Keys that say how a run runs, not what it computes: they may differ when it is resumed.
FREE_KEYS = ("resume", "overwrite", "hydra", "runtime.verbose", "runtime.torch_threads", "runtime.ray_tmp_dir",
             "runtime.ray_address", "runtime.num_cpus_per_team", "runtime.state_dir", "runtime.num_gpus_per_team",
             "runtime.poll_interval", "runtime.batched_threads",  # groups share nothing (tests/test_batched.py)
             "dataset.lazy", "dataset.cache_mb")  # lazy devices are bit-identical to eager ones (tests/test_scale.py)
# Keys added after runs began recording their config, with the value such a run had in effect:
# a run recorded without one resumes with that value.
ADDED_KEYS = {"runtime.dropout": 0.0, "runtime.dropout_nodes": 0.0, "runtime.batch_siblings": False}


@dataclass
class Checkpoint:
    round: int  # the last completed global round
    recorder: dict[str, Any]  # Recorder.state()


def write_checkpoint(run_dir: str | os.PathLike, checkpoint: Checkpoint) -> None:
    """Atomically (a temporary file, then a rename): a run killed while writing keeps the last one."""
    path = Path(run_dir) / CHECKPOINT
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, pickle.dumps(checkpoint, protocol=pickle.HIGHEST_PROTOCOL))


def read_checkpoint(run_dir: str | os.PathLike) -> Checkpoint | None:
    path = Path(run_dir) / CHECKPOINT
    if not path.exists():
        return None
    with path.open("rb") as f:
        return pickle.load(f)  # noqa: S301 - the run's own file


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": leaf}: mappings flattened by key, every other value (lists included) a leaf."""
    if isinstance(value, Mapping) and (value or not prefix):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _free(key: str) -> bool:
    return any(key == free or key.startswith(free + ".") for free in FREE_KEYS)


def differing_keys(saved: Mapping, current: Mapping) -> list[tuple[str, Any, Any]]:
    """(key, the saved value, the current one) for every key (but ``FREE_KEYS``) whose value
    differs or that only one of them has (``<absent>``)."""
    a, b = flatten(saved), flatten(current)
    a = {**{k: v for k, v in ADDED_KEYS.items() if k in b}, **a}
    absent = "<absent>"
    return [(k, a.get(k, absent), b.get(k, absent)) for k in sorted(set(a) | set(b))
            if not _free(k) and (k not in a or k not in b or a[k] != b[k])]


def record_config(cfg: Mapping, run_dir: Path) -> None:
    path = run_dir / CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(cfg, indent=1, sort_keys=True) + "\n").encode())


def state_dir(cfg: Mapping, run_dir: str | os.PathLike) -> Path:
    """Where the run's nodes and devices keep their state (hfl.state.store): ``<run dir>/state`` with
    ``runtime.state_dir`` null, else ``<runtime.state_dir>/<the run's key>``, the key recorded in
    the run directory (``STATE_KEY``) when the run began, so that runs sharing one state_dir never
    touch each other's state and a resumption finds its own wherever state_dir is mounted now.
    Call it after ``prepare``. A resumption whose state_dir disagrees with where the run kept its
    state is refused, naming ``runtime.state_dir``."""
    run_dir = Path(run_dir)
    base = cfg.get("runtime", {}).get("state_dir")
    key_file = run_dir / STATE_KEY
    key = key_file.read_text().strip() if key_file.exists() else None
    if base and key:
        return Path(base) / key
    if not base and not key:
        return run_dir / "state"
    if base:
        raise ConfigError("runtime.state_dir", f"the run in {run_dir} keeps its state in {run_dir / 'state'} (it began "
                                               "with runtime.state_dir=null); resume it with runtime.state_dir=null")
    raise ConfigError("runtime.state_dir", f"the run in {run_dir} keeps its state in the folder {key!r} of the "
                                           "runtime.state_dir it began with; resume it with that directory (its path "
                                           "where every Ray node mounts it now)")


def _new_state_key(cfg: Mapping, run_dir: Path) -> None:
    """A fresh run: with a runtime.state_dir, a folder of its own there (kept when the run
    directory already had one, so rerunning in it reuses, and clears, that folder)."""
    key_file = run_dir / STATE_KEY
    if not cfg.get("runtime", {}).get("state_dir"):
        key_file.unlink(missing_ok=True)
    elif not key_file.exists():
        key_file.parent.mkdir(parents=True, exist_ok=True)
        # The run directory's name is readable; the random part keeps two run directories of
        # the same name (Hydra's time-of-day folders of two days) apart.
        atomic_write_bytes(key_file, f"{run_dir.name}-{uuid.uuid4().hex[:8]}\n".encode())


def prepare(cfg: Mapping, run_dir: str | os.PathLike) -> Checkpoint | None:
    """Run before any node starts (in the driver). A fresh run (``resume`` false) records its
    config and empties its state store (``state_dir``) and checkpoint; a resumption checks the
    config against the recorded one and rolls the store back to the checkpoint's round. Returns
    the checkpoint to go on from; None to start at round 1 (a fresh run, or a run killed before
    it completed a round)."""
    run_dir = Path(run_dir)
    if not cfg.get("resume", False):
        if (run_dir / CONFIG).exists() and not cfg.get("overwrite", False):
            done = read_checkpoint(run_dir)
            rounds = f"{done.round} of {cfg.get('global_rounds')} global rounds done" if done else "no round done"
            raise ConfigError("overwrite", f"{run_dir} holds a run ({rounds}); go on with it with resume=true "
                                           "(and its overrides), or start over there with overwrite=true, which "
                                           "deletes its state, checkpoints and metrics")
        _new_state_key(cfg, run_dir)
        StateStore(state_dir(cfg, run_dir)).clear()
        (run_dir / CHECKPOINT).unlink(missing_ok=True)
        record_config(cfg, run_dir)
        return None
    recorded = run_dir / CONFIG
    if not recorded.exists():
        raise ConfigError("resume", f"{run_dir} holds no run to resume (no {CONFIG}): give the directory of the "
                                    "run as hydra.run.dir, or drop resume=true to start a new run")
    diff = differing_keys(json.loads(recorded.read_text()), cfg)
    if diff:
        shown = "; ".join(f"{key}: {old!r} there, {new!r} here" for key, old, new in diff)
        raise ConfigError("resume", f"{run_dir} holds a run of another configuration; these keys differ: {shown} "
                                    "(resume it with the overrides it was started with)")
    checkpoint = read_checkpoint(run_dir)
    store = state_dir(cfg, run_dir)
    if checkpoint is not None and not store.is_dir():
        # The folder a fresh run created is gone, or state_dir is mounted elsewhere than given:
        # going on would silently restart every device from scratch.
        raise ConfigError("runtime.state_dir", f"the run in {run_dir} completed {checkpoint.round} rounds, but its "
                                               f"state folder {store} does not exist here")
    StateStore(store).rollback(checkpoint.round if checkpoint else 0)
    return checkpoint


class Resumed(Strategy):
    """The root strategy of a resumed run. Flower counts rounds from 1: the strategy sees
    ``offset`` + Flower's round, and starts from the model its rule rebuilt from the store."""

    def __init__(self, inner: Strategy, offset: int) -> None:
        self.inner = inner
        self.offset = offset

    def __getattr__(self, name: str) -> Any:  # anything else is the inner strategy's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"Resumed({self.inner!r}, after round {self.offset})"

    def initialize_parameters(self, client_manager) -> Parameters | None:  # noqa: ANN001
        return ndarrays_to_parameters(self.inner.current)

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001
        return self.inner.configure_fit(server_round + self.offset, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001
        return self.inner.aggregate_fit(server_round + self.offset, results, failures)

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: ANN001
        return self.inner.configure_evaluate(server_round + self.offset, parameters, client_manager)

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: ANN001
        return self.inner.aggregate_evaluate(server_round + self.offset, results, failures)

    def evaluate(self, server_round, parameters):  # noqa: ANN001
        return self.inner.evaluate(server_round + self.offset, parameters)
