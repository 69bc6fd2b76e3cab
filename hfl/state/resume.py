"""Resume a killed ``hfl-simulate`` run from its last completed global round.

``hfl-simulate <the run's overrides> resume=true hydra.run.dir=<its directory>`` ends with the
same models and the same metrics.jsonl (but for wall-clock fields) as a run never interrupted:

- at its start a run records its config (``checkpoints/config.json``); a resumption refuses a
  different one, naming the keys (those in ``FREE_KEYS`` may differ);
- at the end of every global round (after its evaluation, or after its fit when the round is
  not evaluated) the recorder writes ``checkpoints/resume.pkl``: the round, the recorder's
  state (hfl.output.recorder) and the store's manifest (each key's round), once the store is
  fsynced (``StateStore.commit``); the checkpoint before it is kept as ``resume.prev.pkl``;
- every node, the root included (hfl.node.root), and every device keeps its state in the versioned
  store (hfl.state.store): before anything
  runs, a resumption rolls it back to the checkpoint's round R, whatever round R+1 wrote, and the
  recorder rewrites metrics.jsonl and samples.jsonl up to round R;
- the root's round loop (hfl.node.root.RootServer) goes on at round R + 1 with the true global
  rounds (FitIns ``global_round`` and the round paths included, so every seeded stream —
  sampling, device draws, FeMAM's K-means — is the one of those rounds).

Damage (a power cut, a torn write, a deleted file) never resumes silently from the wrong state:
an unreadable checkpoint is passed over for the previous one, with a warning naming it; an
unreadable state version counts as absent; the newest checkpoint whose manifest the store can
still satisfy (each key at exactly its recorded round) is resumed from, else the resumption is
refused naming the files (start over with ``overwrite=true``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


from hfl.errors import ConfigError
from hfl.state.store import StateStore, atomic_write_bytes, fsync_dir

log = logging.getLogger("hfl")

CHECKPOINT = Path("checkpoints") / "resume.pkl"
PREVIOUS_CHECKPOINT = Path("checkpoints") / "resume.prev.pkl"  # the one before: used when resume.pkl is unreadable
# A checkpoint file: this, the pickle's SHA-256, the pickle. A garbled byte could otherwise unpickle
# to other numbers without a word; a file without it is a bare pickle (written by an older hfl).
MAGIC = b"hfl-checkpoint-1\n"
CONFIG = Path("checkpoints") / "config.json"
# The newest checkpoint's round and store manifest, beside the pickle: a damaged resume.pkl still
# says which round it committed and which state versions that round left.
MANIFEST = Path("checkpoints") / "manifest.json"
# Everything a run writes in its directory besides its state and checkpoints: overwrite=true removes
# them before training, so a killed overwrite is never reported with the old run's figures.
OUTPUTS = ("metrics.jsonl", "samples.jsonl", "summary.json", "report.md", "accuracy.png", "loss.png",
           "accuracy_time.png", "loss_time.png", "checkpoints/global_model.npz", str(MANIFEST))
SAMPLES = "samples.jsonl"
# The run's folder under runtime.state_dir (absent when the run keeps its state in <run dir>/state).
STATE_KEY = Path("checkpoints") / "state_key"
# Keys that say how a run runs, not what it computes: they may differ when it is resumed.
FREE_KEYS = ("resume", "overwrite", "hydra", "runtime.verbose", "runtime.torch_threads", "runtime.ray_tmp_dir",
             "runtime.ray_address", "runtime.num_cpus_per_team", "runtime.state_dir", "runtime.num_gpus_per_team",
             "runtime.poll_interval", "runtime.team_wait_seconds",
             "runtime.batched_threads",  # groups share nothing (tests/test_batched.py)
             "dataset.lazy", "dataset.cache_mb")  # lazy devices are bit-identical to eager ones (tests/test_scale.py)
# Keys added after runs began recording their config, with the value such a run had in effect:
# a run recorded without one resumes with that value.
ADDED_KEYS = {"runtime.dropout": 0.0, "runtime.dropout_nodes": 0.0, "runtime.batch_siblings": False,
              "eval_fraction": 1.0,
              # the keys every algorithm has (hfl.config.schema.AlgorithmConfig), recorded since they are declared
              "algorithm.sampling": "children", "algorithm.sample_fraction": 1.0, "algorithm.candidates": 0,
              "algorithm.level_rounds": None, "algorithm.local_labels": False, "algorithm.local_epochs": None,
              # differential privacy (hfl.node.privacy), off
              "privacy.level": "off", "privacy.clip": None, "privacy.adaptive": False, "privacy.target_quantile": 0.5,
              "privacy.clip_lr": 0.2, "privacy.count_stddev": None, "privacy.noise_multiplier": 0.0,
              "privacy.delta": 1e-5, "privacy.target_epsilon": None}


@dataclass
class Checkpoint:
    round: int  # the last completed global round
    recorder: dict[str, Any]  # Recorder.state()
    # Each state store key's round as the round ended (StateStore.commit): what a resumption must
    # find after its rollback. None: not recorded (an older checkpoint, or a store not prepared here).
    store: dict[str, int] | None = None


@dataclass
class _Committed:
    """A run's state store, and the newest modification time its last commit saw (0: none yet)."""
    store: Path
    since_ns: int = 0


# The store of each run directory ``prepare`` readied in this process: write_checkpoint commits
# it (the recorder that calls write_checkpoint knows no store).
_STORES: dict[Path, _Committed] = {}


def _register(run_dir: Path, store: Path) -> None:
    _STORES[run_dir.resolve()] = _Committed(store.resolve())


def write_checkpoint(run_dir: str | os.PathLike, checkpoint: Checkpoint) -> None:
    """Commit a completed round: the run's state store made durable and its manifest recorded
    (when ``prepare`` readied it in this process), then the checkpoint written durably (a
    temporary file, fsync, rename, fsync of the folder), the one it replaces kept as
    ``resume.prev.pkl``. A run killed or cut off at any point keeps a checkpoint whose state is on disk."""
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT
    path.parent.mkdir(parents=True, exist_ok=True)
    known = _STORES.get(run_dir.resolve())
    if known is not None and known.store.is_dir():
        manifest, known.since_ns = StateStore(known.store).commit(known.since_ns)
        checkpoint = replace(checkpoint, store=manifest)
    data = pickle.dumps(checkpoint, protocol=pickle.HIGHEST_PROTOCOL)
    if checkpoint.store is not None:  # not fsynced itself: its rename is, with the checkpoint's folder below
        atomic_write_bytes(run_dir / MANIFEST, json.dumps({"round": checkpoint.round, "store": checkpoint.store},
                                                          sort_keys=True).encode())
    atomic_write_bytes(path, MAGIC + hashlib.sha256(data).digest() + data, sync=True,
                       keep=run_dir / PREVIOUS_CHECKPOINT)


def _load_checkpoint(path: Path) -> Checkpoint:
    data = path.read_bytes()
    if data.startswith(MAGIC):
        digest, data = data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
        if hashlib.sha256(data).digest() != digest:
            raise ValueError(f"its checksum does not match its {len(data)} bytes (torn or garbled)")
    elif not data:
        raise ValueError("it is empty")
    checkpoint = pickle.loads(data)  # noqa: S301 - the run's own file
    if not isinstance(checkpoint, Checkpoint) or not isinstance(checkpoint.round, int):
        raise ValueError(f"holds a {type(checkpoint).__name__}, not a checkpoint")
    return checkpoint


def _checkpoints(run_dir: Path) -> tuple[list[tuple[Path, Checkpoint]], list[tuple[Path, str]]]:
    """The readable checkpoints, newest first (resume.pkl, then resume.prev.pkl), and the
    unreadable ones with why; a missing file is neither."""
    readable, damaged = [], []
    for path in (run_dir / CHECKPOINT, run_dir / PREVIOUS_CHECKPOINT):
        if not path.exists():
            continue
        try:
            readable.append((path, _load_checkpoint(path)))
        except Exception as exc:  # noqa: BLE001 - whatever a torn or garbled pickle raises
            damaged.append((path, " ".join(f"{type(exc).__name__}: {exc}".split())))
    readable.sort(key=lambda found: -found[1].round)
    return readable, damaged


def _unreadable(run_dir: Path, damaged: list[tuple[Path, str]]) -> ConfigError:
    shown = "; ".join(f"{path} is unreadable ({why})" for path, why in damaged)
    if len(damaged) == 1:
        other = run_dir / (CHECKPOINT if damaged[0][0] == run_dir / PREVIOUS_CHECKPOINT else PREVIOUS_CHECKPOINT)
        shown += f", and {other} is missing"
    return ConfigError("resume", f"{shown}: the run in {run_dir} cannot be resumed; start over there with "
                                 "overwrite=true")


def read_checkpoint(run_dir: str | os.PathLike) -> Checkpoint | None:
    """The newest readable checkpoint (resume.pkl, else resume.prev.pkl), or None if there is
    none; refused (ConfigError naming the files) if the checkpoints there are all unreadable."""
    readable, damaged = _checkpoints(Path(run_dir))
    if readable:
        return readable[0][1]
    if damaged:
        raise _unreadable(Path(run_dir), damaged)
    return None


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
    atomic_write_bytes(path, (json.dumps(cfg, indent=1, sort_keys=True) + "\n").encode(), sync=True)


def state_dir(cfg: Mapping, run_dir: str | os.PathLike) -> Path:
    """Where the run's nodes and devices keep their state (hfl.state.store): ``<run dir>/state`` with
    ``runtime.state_dir`` null, else ``<runtime.state_dir>/<the run's key>``, the key recorded in
    the run directory (``STATE_KEY``) when the run began, so that runs sharing one state_dir never
    touch each other's state and a resumption finds its own wherever state_dir is mounted now.
    Call it after ``prepare``. A resumption whose state_dir disagrees with where the run kept its
    state is refused, naming ``runtime.state_dir``."""
    run_dir = Path(run_dir)
    base = cfg["runtime"]["state_dir"]
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
    if not cfg["runtime"]["state_dir"]:
        key_file.unlink(missing_ok=True)
    elif not key_file.exists():
        key_file.parent.mkdir(parents=True, exist_ok=True)
        # The run directory's name is readable; the random part keeps two run directories of
        # the same name (Hydra's time-of-day folders of two days) apart.
        atomic_write_bytes(key_file, f"{run_dir.name}-{uuid.uuid4().hex[:8]}\n".encode(), sync=True)


def held_run(run_dir: Path) -> list[str]:
    """The files that show a run in ``run_dir`` (its recorded config, checkpoints, outputs, state
    key or stored state): the overwrite guard reads all of them, so losing one file does not
    disarm it."""
    found = [str(name) for name in (CONFIG, CHECKPOINT, PREVIOUS_CHECKPOINT, MANIFEST, STATE_KEY, *OUTPUTS)
             if (run_dir / name).exists() and (str(name) != "metrics.jsonl" or (run_dir / name).stat().st_size)]
    if (run_dir / "state").is_dir() and StateStore(run_dir / "state").keys():
        found.append("state/")
    return sorted(set(found))


def _start_over(cfg: Mapping, run_dir: Path) -> Path:
    """overwrite=true (or a directory holding no run): the old run's checkpoints first (it can no
    longer be resumed half-deleted), then every output it wrote, then its state. Returns the store."""
    for name in (CHECKPOINT, PREVIOUS_CHECKPOINT, MANIFEST, *OUTPUTS):
        (run_dir / name).unlink(missing_ok=True)
    _new_state_key(cfg, run_dir)
    store = state_dir(cfg, run_dir)
    StateStore(store).clear()
    return store


def samples_digest(lines: list[str]) -> str:
    """What a checkpoint records of samples.jsonl's rows up to its round (their text, in order)."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def rows_up_to(path: Path, key: str, last_round: int) -> list[str]:
    """The lines of a .jsonl file whose ``key`` is at most ``last_round`` (a line cut short by a
    killed run is dropped)."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get(key), int) and row[key] <= last_round:
            kept.append(line)
    return kept


def check_samples(run_dir: Path, checkpoint: Checkpoint, kept: list[str]) -> None:
    """Refuse (naming samples.jsonl) a resumption whose samples rows up to the checkpoint's round
    are not those it recorded: a damaged or deleted file would silently lose rows."""
    recorded = checkpoint.recorder.get("samples") if isinstance(checkpoint.recorder, dict) else None
    if not recorded:
        return  # a checkpoint of an older hfl recorded nothing
    if len(kept) != recorded["rows"] or samples_digest(kept) != recorded["sha256"]:
        raise ConfigError("resume", f"{run_dir / SAMPLES} is damaged: its rows up to global round {checkpoint.round} "
                                    f"are not those the checkpoint recorded ({len(kept)} readable of "
                                    f"{recorded['rows']}, or their text differs); restore the file, or start over "
                                    "with overwrite=true")


def prepare(cfg: Mapping, run_dir: str | os.PathLike) -> Checkpoint | None:
    """Run before any node starts (in the driver). A fresh run (``resume`` false) records its
    config and empties its state store (``state_dir``) and checkpoints; a resumption checks the
    config against the recorded one, picks the newest checkpoint the store still matches and rolls
    the store back to its round (``_resumable``). Returns the checkpoint to go on from; None to
    start at round 1 (a fresh run, or a run killed before it completed a round)."""
    run_dir = Path(run_dir)
    if not cfg["resume"]:
        held = held_run(run_dir)
        if held and not cfg["overwrite"]:
            try:
                done = read_checkpoint(run_dir)
                rounds = f"{done.round} of {cfg.get('global_rounds')} global rounds done" if done else "no round done"
            except ConfigError:
                rounds = "its checkpoints unreadable"
            if not (run_dir / CONFIG).exists():
                rounds += f", its {CONFIG} missing"
            raise ConfigError("overwrite", f"{run_dir} holds a run ({rounds}); go on with it with resume=true "
                                           "(and its overrides), or start over there with overwrite=true, which "
                                           "deletes its state, checkpoints, metrics, summary, report and plots")
        store = _start_over(cfg, run_dir)
        record_config(cfg, run_dir)
        _register(run_dir, store)
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
    store = state_dir(cfg, run_dir)
    checkpoint = _resumable(run_dir, store)
    _register(run_dir, store)
    return checkpoint


def _manifest_round(run_dir: Path) -> int | None:
    """The round the newest checkpoint committed, as its manifest beside it says (None: unreadable)."""
    try:
        return int(json.loads((run_dir / MANIFEST).read_text())["round"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _resumable(run_dir: Path, store_dir: Path) -> Checkpoint | None:
    """The checkpoint to go on from, the store rolled back to its round: the newest readable one
    whose manifest the store satisfies; refused, naming the files, if there is none."""
    readable, damaged = _checkpoints(run_dir)
    committed = _manifest_round(run_dir)
    for path, why in damaged:
        log.warning("hfl: checkpoint %s is unreadable (%s)%s%s", path, why,
                    f"; {run_dir / MANIFEST} says it committed global round {committed}"
                    if committed is not None and path == run_dir / CHECKPOINT else "",
                    "; trying the one before it" if readable else "")
    if not readable:
        if damaged:
            raise _unreadable(run_dir, damaged)
        store = StateStore(store_dir)
        stored = store.plan(2**62)[0]
        later = max([rnd for rnd, _ in stored.values()] + [_manifest_round(run_dir) or 0])
        if later >= 2:  # a node ran round 2, so round 1 was checkpointed: the checkpoint is lost
            raise ConfigError("resume", f"{run_dir / CHECKPOINT} is missing, yet the run's state in {store_dir} "
                                        f"reaches global round {later}: the run cannot be resumed; start over "
                                        "there with overwrite=true")
        _warn_removed(store.rollback(0))
        return None
    if not store_dir.is_dir():
        # The folder a fresh run created is gone, or state_dir is mounted elsewhere than given:
        # going on would silently restart every device from scratch.
        raise ConfigError("runtime.state_dir", f"the run in {run_dir} completed {readable[0][1].round} rounds, but "
                                               f"its state folder {store_dir} does not exist here")
    store = StateStore(store_dir)
    refused: list[tuple[Checkpoint, list[str]]] = []
    for path, checkpoint in readable:
        problems = mismatches(store, checkpoint)
        if problems:
            refused.append((checkpoint, problems))
            continue
        check_samples(run_dir, checkpoint, rows_up_to(run_dir / SAMPLES, "global_round", checkpoint.round))
        if refused:
            log.warning("hfl: the state of global round %d is damaged (%s); resuming after round %d, from %s",
                        refused[0][0].round, "; ".join(refused[0][1]), checkpoint.round, path)
        _warn_removed(store.rollback(checkpoint.round))
        after = mismatches(store, checkpoint)  # what is on disk now, against the manifest
        if after:
            raise ConfigError("resume", f"after rolling {store_dir} back to global round {checkpoint.round}: "
                                        f"{'; '.join(after)}; start over with overwrite=true")
        if path != run_dir / CHECKPOINT:  # the checkpoint gone on from is the newest again
            os.replace(path, run_dir / CHECKPOINT)
            fsync_dir(path.parent)
        return checkpoint
    newest, problems = refused[0]
    unread = "".join(f"{path} is unreadable ({why}); " for path, why in damaged)
    if not (run_dir / CHECKPOINT).exists():
        unread += f"{run_dir / CHECKPOINT} is missing; "
    older = (f"; the older checkpoint (round {refused[1][0].round}) does not match the stored state either"
             if len(refused) > 1 else "; there is no older checkpoint to go back to")
    raise ConfigError("resume", f"{unread}the state needed to go on after global round {newest.round} is damaged: "
                                f"{'; '.join(problems)}{older}; start over with overwrite=true")


def mismatches(store: StateStore, checkpoint: Checkpoint) -> list[str]:
    """How the store, rolled back to the checkpoint's round, would differ from its manifest:
    one phrase per key, naming the file (none without a manifest)."""
    if checkpoint.store is None:
        return []
    kept, damaged = store.plan(checkpoint.round)
    problems = []
    for key, rnd in sorted(checkpoint.store.items()):
        found = kept.get(key)
        if found is not None and found[0] == rnd:
            continue
        newest = store.root / f"{key}.npz"
        bad = [str(p) for p in damaged if p.name == newest.name]
        if bad:
            problems.append(f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} unreadable (round {rnd} of "
                            f"{key} is needed)")
        elif found is None:
            problems.append(f"{newest} is missing (round {rnd} of {key} is needed)")
        else:
            problems.append(f"{newest} is missing its round-{rnd} version (only round {found[0]} is stored)")
    return problems


def _warn_removed(removed: list[Path]) -> None:
    for path in removed:
        log.warning("hfl: removed the unreadable state file %s (counted as absent)", path)

