"""Keys nothing reads and values that cannot work (issue 46, item 3): each case is a bad config ->
a one-line refusal naming the key and the cause, before training. A key added with ``+``/``++``
that no schema declares is refused with the closest real key or the option that has it; hfl's own
hint never suggests ``+`` for a misspelling; every numeric key of every algorithm is range-checked."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from hfl.config import schema
from hfl.config.checks import validate
from hfl.errors import ConfigError
from hfl.config.compose import CONF_DIR, compose_config
from hfl.runtime.simulate import run
from tests.conftest import SMALL, compose_cfg

ROOT = Path(__file__).parents[1]
DEMO = ["experiment=demo", "global_rounds=1"]


def composed(*overrides: str):  # noqa: ANN201 - an OmegaConf DictConfig (it still knows each node's schema)
    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# ---------------------------------------------------------------- keys nothing reads: the CLI, one line
@pytest.mark.parametrize(("override", "line"), [
    ("+algorithm.alhpa=0.5", "algorithm.alhpa: no such key; did you mean algorithm.alpha?"),
    ("+clock.polcy=buffered", "clock.polcy: no such key; did you mean clock.policy?"),
    ("+eval_fractoin=0.5", "eval_fractoin: no such key; did you mean eval_fraction?"),
])
def test_hfl_simulate_refuses_an_added_key_nothing_reads_in_one_line(tmp_path, override, line):
    script = Path(sys.executable).with_name("hfl-simulate")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "hfl.runtime.simulate"]
    done = subprocess.run([*argv, *DEMO, override, f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"hfl-simulate: {line}"]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "state").exists()


# ---------------------------------------------------------------- keys nothing reads: compose_config
@pytest.mark.parametrize(("overrides", "message"), [
    ("+topology.fanout=[2,3]", "topology.fanout: no such key in this topology; it belongs to topology=tree"),
    ("algorithm=fedavg +algorithm.eta=0.1", "algorithm.eta: no such key in this algorithm; it belongs to algorithm=permfl"),
    ("algorithm=fedavg ++algorithm.mu=0.1", "algorithm.mu: no such key in this algorithm; it belongs to "
                                            "algorithm=demlearn or algorithm=fedprox"),
    ("+dataset.batchsize=8", "dataset.batchsize: no such key; did you mean dataset.batch_size?"),
    ("+runtime.torch_thread=2", "runtime.torch_thread: no such key; did you mean runtime.torch_threads?"),
    ("algorithm=bhfl +algorithm.up.lrr=0.1", "algorithm.up.lrr: no such key; did you mean algorithm.up.lr?"),
    ("+clock.staleness.c=1", "clock.staleness.c: no such key; the keys of clock.staleness: a, b, function"),
    ("+clock.shift.perod=5", "clock.shift.perod: no such key; did you mean clock.shift.period?"),
    ("+alpha=0.5", "alpha: no such key; did you mean algorithm.alpha?"),
    ("+logger.colour=red", "logger.colour: no such key; the keys of logger: name"),
])
def test_an_added_key_nothing_reads_is_refused_naming_the_real_one(overrides, message):
    with pytest.raises(ConfigError) as caught:
        compose_config(overrides, 0)
    assert str(caught.value) == message
    assert caught.value.key == message.split(":")[0]


@pytest.mark.parametrize("override", ["global_round=5", "algorithm.alhpa=1", "clock.staleness.c=1",
                                      "algorithm=bhfl algorithm.up.lrr=1", "topology.fanout=[2,3]"])
def test_hfls_hint_for_a_misspelt_key_never_suggests_adding_it(override):
    with pytest.raises(ConfigCompositionException) as caught:
        compose_cfg(*override.split())
    error = schema.config_error(caught.value)
    assert isinstance(error, ConfigError) and "no such key" in str(error)
    assert "+" not in str(error)


@pytest.mark.parametrize("overrides", [
    ["algorithm=hierfavg", "++algorithm.sample_fraction=[1,0.2]"],  # read by the engine for every algorithm
    ["algorithm=bhfl", "+algorithm.levels.0.up={optimizer: adam, lr: 0.01}"],  # keyed by depth, checked by B-HFL
    ["runtime.state_dir=/tmp"],  # declared for every runtime
    ["hydra.run.dir=/tmp/elsewhere"],  # Hydra's own keys
])
def test_keys_that_are_read_stay_open(overrides):
    schema.check_keys(composed(*overrides))


# ---------------------------------------------------------------- values that cannot work
@pytest.mark.parametrize(("overrides", "message"), [
    ("algorithm=bhfl algorithm.background_every=-1", "algorithm.background_every: must be >= 0, got -1.0"),
    ("algorithm=bhfl algorithm.background_max=-1", "algorithm.background_max: must be >= 0, got -1"),
    ("algorithm=bhfl algorithm.proxy_staleness=1.5", "algorithm.proxy_staleness: must be in [0, 1], got 1.5"),
    ("algorithm=bhfl algorithm.proxy_steps=0", "algorithm.proxy_steps: must be >= 1, got 0"),
    ("algorithm=bhfl algorithm.proxy_lr=-0.1", "algorithm.proxy_lr: must be > 0, got -0.1"),
])
def test_a_value_that_cannot_work_is_refused_naming_its_range(overrides, message):
    with pytest.raises(ConfigError) as caught:
        compose_config(overrides, 0)
    assert str(caught.value) == message


def test_more_clusters_than_devices_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"^algorithm\.num_clusters: must be in \[1, 6\] .* got 50$"):
        run(compose_cfg(*SMALL, "algorithm=ifca", "algorithm.num_clusters=50"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "state").exists()


def test_a_trace_naming_a_device_the_federation_lacks_is_refused(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("device_id,speed\n0,1.0\n99,2.0\n")
    with pytest.raises(ConfigError, match=r"^clock\.trace: .*trace\.csv names device 99, which this federation "
                                          r"lacks: its devices are 0\.\.5$"):
        run(compose_cfg(*SMALL, "clock.enabled=true", f"clock.trace={trace}"), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# Numeric keys a negative value of which is meaningful: pFedBayes's rho offset is any real (softplus(rho)).
UNBOUNDED = {"rho_offset"}


def _numeric_keys(cls: type) -> list[tuple[str, ...]]:
    hints = typing.get_type_hints(cls, vars(schema))
    keys: list[tuple[str, ...]] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if kind in (int, float) and f.name not in UNBOUNDED:
            keys.append((f.name,))
        elif dataclasses.is_dataclass(kind):
            sub = typing.get_type_hints(kind, vars(schema))
            keys += [(f.name, g.name) for g in dataclasses.fields(kind) if sub[g.name] in (int, float)]
    return keys


def test_every_numeric_key_of_every_algorithm_refuses_a_negative_value():
    """One sweep over the schemas: a new numeric key without a range check fails here."""
    for option, cls in sorted(schema._options("algorithm").items()):
        base = OmegaConf.to_container(composed(f"algorithm={option}"), resolve=True)
        validate(base)
        for path in _numeric_keys(cls):
            cfg = copy.deepcopy(base)
            node = cfg["algorithm"]
            for part in path[:-1]:
                node = node[part]
            node[path[-1]] = -1
            key = "algorithm." + ".".join(path)
            with pytest.raises(ConfigError) as caught:
                validate(cfg)
            assert caught.value.key == key, f"algorithm={option}: {key}=-1 passed ({caught.value})"
