"""Checks on the composed configuration, run before any training starts."""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from hfl.errors import ConfigError, check_number, check_number_list

MISSING = "???"  # OmegaConf's mark for a value no config gave (omegaconf.MISSING)

RUNTIMES = ("simulation", "inprocess", "deployment")


def _number(cfg: Mapping, path: str, *, minimum: float, integer: bool = False, strict: bool = False) -> None:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ConfigError(path, "missing")
        node = node[part]
    check_number(path, node, integer=integer, minimum=minimum, open_min=strict)


def load_module(alg: Mapping, role: str) -> ModuleType:
    """The algorithm's strategy or client module, named in its config."""
    name = alg.get(role)
    try:
        return importlib.import_module(str(name))
    except ImportError as exc:
        raise ConfigError(f"algorithm.{role}", f"cannot import {name!r}: {exc}") from exc


def load_server(alg: Mapping) -> type:
    """The algorithm's server rule: ``SERVER`` of its strategy module, a subclass of
    ``hfl.algorithm.ServerRule`` (the written protocol)."""
    from hfl.algorithm import ServerRule

    module = load_module(alg, "strategy")
    server = getattr(module, "SERVER", None)
    if not (isinstance(server, type) and issubclass(server, ServerRule)):
        raise ConfigError("algorithm.strategy", f"module {module.__name__} has no SERVER (a subclass of "
                                                "hfl.algorithm.ServerRule)")
    return server


def client_class(alg: Mapping) -> type:
    """The algorithm's device client class: the module's ``CLIENT`` if it names one, else the class
    its ``make_client`` returns (its return annotation), a subclass of hfl.device.client.DeviceClient.
    What the device is (``batched``, ``bufferless``) is read from it."""
    import typing

    from hfl.device.client import DeviceClient

    module = load_module(alg, "client")
    found = getattr(module, "CLIENT", None)
    if found is None and callable(getattr(module, "make_client", None)):
        try:
            found = typing.get_type_hints(module.make_client).get("return")
        except (NameError, TypeError):
            found = None
    if not (isinstance(found, type) and issubclass(found, DeviceClient)):
        raise ConfigError("algorithm.client", f"module {module.__name__}: make_client must be annotated with the "
                                              "DeviceClient subclass it returns (or the module must name it as CLIENT)")
    return found


# children: every node samples ``sample_fraction`` of its children per round (per level);
# devices: the root draws ``sample_fraction`` of all devices per global round (uniform across the
# tree, PFLEGO) and a node asks only the children holding a drawn device.
SAMPLINGS = ("children", "devices")


def _check_levels(alg: Mapping) -> None:
    """Per-level settings: ``level_rounds`` (null or a list of ints >= 1, levels 1..D-1) and
    ``sample_fraction`` (a number in (0, 1] or such a list, root first; one number with
    ``sampling=devices``). Their lengths are checked against the tree once it is built
    (hfl.runtime.build.check_tree)."""
    for key in ("persistent_devices", "local_labels", "fit_test"):
        if key in alg and not isinstance(alg[key], bool):
            raise ConfigError(f"algorithm.{key}", f"must be true or false, got {alg[key]!r}")
    if alg["level_rounds"] is not None:
        check_number_list("algorithm.level_rounds", alg["level_rounds"], "rounds per level", integer=True, minimum=1)
    fraction = alg["sample_fraction"]
    sampling = alg["sampling"]
    if sampling not in SAMPLINGS:
        raise ConfigError("algorithm.sampling", f"unknown sampling {sampling!r}; known: {', '.join(SAMPLINGS)}")
    if sampling == "devices" and isinstance(fraction, list | tuple):
        raise ConfigError("algorithm.sample_fraction", "with algorithm.sampling=devices it is one number: the "
                                                       f"fraction of all devices drawn per global round, got {fraction!r}")
    values = fraction if isinstance(fraction, list | tuple) else [fraction]
    if not values:
        raise ConfigError("algorithm.sample_fraction", "must be a number or a non-empty list")
    for i, value in enumerate(values):
        key = f"algorithm.sample_fraction[{i}]" if isinstance(fraction, list | tuple) else "algorithm.sample_fraction"
        check_number(key, value, minimum=0, maximum=1, open_min=True)
    _check_candidates(alg)


def _check_candidates(alg: Mapping) -> None:
    """``candidates`` (power-of-choice, hfl.node.cohort): 0 (none) or a share in (0, 1], a number or a
    list root first; checked against each level's sample_fraction once the tree is built
    (hfl.runtime.build.check_tree)."""
    candidates = alg["candidates"]
    listed = isinstance(candidates, list | tuple)
    values = list(candidates) if listed else [candidates]
    if not values:
        raise ConfigError("algorithm.candidates", "must be a number or a non-empty list")
    for i, value in enumerate(values):
        check_number(f"algorithm.candidates[{i}]" if listed else "algorithm.candidates", value, minimum=0, maximum=1)
    if any(values) and alg["sampling"] == "devices":
        raise ConfigError("algorithm.candidates", "a loss-aware choice of children needs algorithm.sampling=children "
                                                  "(with sampling=devices the root draws the devices)")


def check_fractions(key: str, value: Any) -> list[float]:
    """A fraction in (0, 1] or a non-empty list of them (root first), each error naming ``key``
    (``key[i]`` for a list's entry); the lengths are checked against the tree once it is built
    (hfl.runtime.build.check_tree)."""
    values = list(value) if isinstance(value, list | tuple) else [value]
    if not values:
        raise ConfigError(key, "must be a number or a non-empty list")
    for i, item in enumerate(values):
        check_number(f"{key}[{i}]" if isinstance(value, list | tuple) else key, item, minimum=0, maximum=1,
                     open_min=True)
    return [float(v) for v in values]


def check_finite(value: Any, key: str = "") -> None:
    """Refuse, naming its key, every NaN or infinite number anywhere in ``value`` (nested
    mappings and lists; list entries are named ``key[i]``), and every value a schema left
    missing (``???``: no config file or override gave one)."""
    if isinstance(value, Mapping):
        for name, item in value.items():
            check_finite(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_finite(item, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")
    elif isinstance(value, str) and value == MISSING:
        raise ConfigError(key, "missing: no value given (conf/ or an override must set it)")


def validate(cfg: Mapping) -> None:
    """Raise ConfigError naming the first invalid key. Types are the schema's (hfl/config/schema.py,
    checked by Hydra while composing); this checks what a type cannot say. Data and topology
    keys are checked by ``hfl.data.build_federation`` when the federation is built (also
    before training)."""
    check_finite(cfg)
    _number(cfg, "global_rounds", minimum=1, integer=True)
    _number(cfg, "eval_every", minimum=1, integer=True)
    check_fractions("eval_fraction", cfg["eval_fraction"])
    _number(cfg, "seed", minimum=0, integer=True)
    _number(cfg, "dataset.batch_size", minimum=1, integer=True)
    _number(cfg, "algorithm.team_rounds", minimum=1, integer=True)
    _number(cfg, "algorithm.local_steps", minimum=1, integer=True)
    _number(cfg, "algorithm.alpha", minimum=0, strict=True)
    alg = cfg["algorithm"]
    if "min_fit_fraction" in alg:
        _number(cfg, "algorithm.min_fit_fraction", minimum=0, strict=True)
        if alg["min_fit_fraction"] > 1:
            raise ConfigError("algorithm.min_fit_fraction", f"must be <= 1, got {alg['min_fit_fraction']}")
    if not isinstance(alg.get("weighted"), bool):
        raise ConfigError("algorithm.weighted", f"must be true or false, got {alg.get('weighted')!r}")
    # An algorithm checks its own hyper-parameters (raising ConfigError) before training: its
    # server's, and its device client module's own check_config, which the protocol leaves optional.
    load_server(alg).check_config(alg)
    client = load_module(alg, "client")
    if not callable(getattr(client, "make_client", None)):
        raise ConfigError("algorithm.client", f"module {client.__name__} lacks make_client")
    getattr(client, "check_config", lambda alg: None)(alg)
    _check_levels(alg)
    runtime = cfg["runtime"]
    if runtime.get("name") not in RUNTIMES:
        raise ConfigError("runtime.name", f"unknown runtime {runtime.get('name')!r}; known: {', '.join(RUNTIMES)}")
    _number(cfg, "runtime.torch_threads", minimum=1, integer=True)
    if "batched_threads" in runtime:  # simulation and inprocess (a deployment never batches)
        _number(cfg, "runtime.batched_threads", minimum=1, integer=True)
    for key in ("dropout", "dropout_nodes"):  # simulated faults (hfl.node.faults)
        if key in runtime:
            check_number(f"runtime.{key}", runtime[key], minimum=0, maximum=1, open_max=True)
            if runtime[key] > 0 and runtime.get("name") == "deployment":
                raise ConfigError(f"runtime.{key}", "simulated faults are for runtime=simulation and "
                                                    "runtime=inprocess; a deployment has real ones")
    _check_accelerators(alg, runtime)
    address = runtime.get("ray_address")
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ConfigError("runtime.ray_address", "must be null (a fresh local Ray instance) or the address of a Ray "
                                                 f"cluster ('auto', 'host:port', 'ray://host:port'), got {address!r}")
    check_state_dir(runtime)
    check_privacy(cfg)


PRIVACY_LEVELS = ("off", "local", "lowest", "root")


def check_privacy(cfg: Mapping) -> None:
    """The ``privacy`` section (hfl.node.privacy) and what it cannot go with: algorithms whose node step
    needs its children's individual replies (gradient relays, cluster sums, B-HFL's residual edges),
    a loss-aware or timed choice of children (the accountant assumes a uniform sample)."""
    privacy = cfg.get("privacy")
    if not isinstance(privacy, Mapping):
        return
    level = privacy.get("level")
    if level is False:  # YAML 1.1 reads an unquoted `off` as false
        return
    text = str(level).lower()
    if isinstance(level, bool) or (text not in PRIVACY_LEVELS and not (isinstance(level, int) and level >= 0)):
        raise ConfigError("privacy.level", f"must be off, local, lowest, root or a node level (0 = root), got {level!r}")
    if text == "off":
        return
    clip, noise = privacy.get("clip"), privacy.get("noise_multiplier")
    if clip is not None:
        check_number("privacy.clip", clip, minimum=0, open_min=True)
    check_number("privacy.noise_multiplier", noise, minimum=0)
    check_number("privacy.delta", privacy.get("delta"), minimum=0, maximum=1, open_min=True, open_max=True)
    if noise > 0 and clip is None:
        raise ConfigError("privacy.clip", "noise needs a clipping norm C (the noise std is noise_multiplier x C / n)")
    if text == "local" and clip is None:
        raise ConfigError("privacy.clip", "local DP needs a clipping norm C: each device clips its own update")
    if privacy.get("adaptive"):
        if text == "local":
            raise ConfigError("privacy.adaptive", "adaptive clipping is central DP's: with local DP devices clip to "
                                                  "a fixed privacy.clip")
        if clip is None:
            raise ConfigError("privacy.clip", "adaptive clipping starts from privacy.clip: give one")
        check_number("privacy.target_quantile", privacy.get("target_quantile"), minimum=0, maximum=1)
        check_number("privacy.clip_lr", privacy.get("clip_lr"), minimum=0, open_min=True)
        if privacy.get("count_stddev") is not None:
            check_number("privacy.count_stddev", privacy.get("count_stddev"), minimum=0, open_min=True)
    target = privacy.get("target_epsilon")
    if target is not None:
        check_number("privacy.target_epsilon", target, minimum=0, open_min=True)
        if noise == 0:
            raise ConfigError("privacy.target_epsilon", "a budget needs noise: privacy.noise_multiplier is 0, so "
                                                        "epsilon is infinite after one round")
    if cfg["clock"]["enabled"]:
        raise ConfigError("clock.enabled", "privacy: the accountant assumes each round samples children uniformly "
                                           "at random; the clock picks them by speed (use clock.enabled=false)")
    alg = cfg["algorithm"]
    candidates = alg["candidates"]
    if any(float(c) > 0 for c in (candidates if isinstance(candidates, list | tuple) else [candidates])):
        raise ConfigError("algorithm.candidates", "privacy: power-of-choice picks children by their loss, not at "
                                                  "random, so the accountant's sampling rate does not hold")
    server = load_server(alg)
    name = alg.get("name")
    if server.reply_kind != "model":
        raise ConfigError("privacy.level", f"{name}'s servers relay {server.reply_kind}s, not model updates: "
                                           "clipping and noising a model update does not apply")
    if not server.level_models:
        raise ConfigError("privacy.level", f"{name}'s servers need their children's individual replies (cluster "
                                           "sums or relayed device models), not one noised mean")
    if int(alg.get("residual_up_k") or 0) > 0:
        raise ConfigError("algorithm.residual_up_k", "privacy: residual edges forward individual children's "
                                                     "models up the tree, past the noised mean (use 0)")


DEVICES = ("auto", "cpu", "cuda")
BATCHED = ("auto", "on", "off")


def batched_setting(runtime: Mapping) -> str:
    """``runtime.batched`` as one of auto|on|off (YAML reads a bare on/off as a boolean)."""
    value = runtime["batched"]
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        return "on" if str(value).lower() == "true" else "off"
    return str(value).lower()


def _check_accelerators(alg: Mapping, runtime: Mapping) -> None:
    device = str(runtime["device"]).lower()
    if device not in DEVICES:
        raise ConfigError("runtime.device", f"must be one of {', '.join(DEVICES)}, got {runtime['device']!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("runtime.device", "cuda was asked for but torch sees no CUDA GPU on this machine "
                                                "(runtime.device=auto falls back to the CPU)")
    batched = batched_setting(runtime)
    if batched not in BATCHED:
        raise ConfigError("runtime.batched", f"must be one of {', '.join(BATCHED)}, got {runtime.get('batched')!r}")
    if batched == "on" and not client_class(alg).batched:
        raise ConfigError("runtime.batched", f"algorithm {alg.get('name')!r} has no batched device path "
                                             f"({client_class(alg).__name__}.batched is false); use "
                                             "runtime.batched=auto or off")
    if batched == "on" and runtime.get("name") == "deployment":
        raise ConfigError("runtime.batched", "every device is its own process in a deployment; use auto or off")
    gpus = runtime.get("num_gpus_per_team")
    if gpus is not None:
        check_number("runtime.num_gpus_per_team", gpus, minimum=0)
    poll = runtime.get("poll_interval")
    if poll is not None:  # seconds: below 1 ms a loop only spins; above 1 s (a value meant in ms?) rounds crawl
        check_number("runtime.poll_interval", poll, minimum=0.001, maximum=1.0)


def check_state_dir(runtime: Mapping) -> None:
    """``runtime.state_dir``: null (the run directory's ``state/``), or the absolute path of a
    directory every Ray node mounts (and the driver, which prepares and rolls back the store).
    Relative paths are refused: each Ray worker would resolve it against its own working
    directory. A directory that does not exist yet must be creatable."""
    import os
    from pathlib import Path

    value = runtime["state_dir"]
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigError("runtime.state_dir", "must be null (the run directory's state/) or the absolute path "
                                               f"of a directory every Ray node mounts, got {value!r}")
    path = Path(value)
    if not path.is_absolute():
        raise ConfigError("runtime.state_dir", f"must be an absolute path (every Ray node resolves it alike), "
                                               f"got {value!r}")
    existing = next(p for p in (path, *path.parents) if p.exists())  # "/" always exists
    if not existing.is_dir():
        raise ConfigError("runtime.state_dir", f"{value}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("runtime.state_dir", f"{value}: {existing} is not writable here")


def check_model_buffers(cfg: Mapping, has_buffers: bool) -> None:
    """Refuse, naming ``model.name``, a model with buffers (``LocalTrainer(model).has_buffers``)
    under an algorithm whose device cannot carry them (``DeviceClient.bufferless``: it steps
    models outside hfl.device.training.run_local_steps, so BatchNorm's running statistics would
    not follow its training). To be called before training."""
    alg = cfg["algorithm"]
    why = client_class(alg).bufferless if has_buffers else ""
    if why:
        raise ConfigError("model.name", f"{cfg['model'].get('name')!r} keeps BatchNorm running statistics, which "
                                        f"algorithm {alg.get('name')!r} cannot carry (its device "
                                        f"{why}); use a model without BatchNorm")
