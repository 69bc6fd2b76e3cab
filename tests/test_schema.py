"""The config schema (hfl/config/schema.py): Hydra refuses a wrong type while composing, naming the
key; every NaN or infinite number is refused before training, naming the key; the schema
declares types only (the values stay conf/'s); hfl-simulate prints either refusal as one line."""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import MISSING, OmegaConf

from hfl.config import schema
from hfl.config.compose import CONF_DIR
from hfl.config.checks import validate
from hfl.errors import ConfigError, check_number
from hfl.runtime.simulate import run
from tests.conftest import SMALL, compose_cfg

ROOT = Path(__file__).parents[1]


# ---------------------------------------------------------------- wrong types: the schema


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.local_steps=abc"], "algorithm.local_steps: must be an integer, got 'abc'"),
        (["global_rounds=1.5"], "global_rounds: must be an integer, got 1.5"),
        (["algorithm.prox_slip=maybe"], "algorithm.prox_slip: must be true or false, got 'maybe'"),
        (["algorithm.alpha=fast"], "algorithm.alpha: must be a number, got 'fast'"),
        (["algorithm.eta=abc"], "algorithm.eta: must be a number, got 'abc'"),  # PerMFL's own key
        (["dataset.batch_size=true"], "dataset.batch_size: must be an integer, got True"),
        (["dataset.max_samples=1.5"], "dataset.max_samples: must be an integer, got 1.5"),
        (["runtime.verbose=loud"], "runtime.verbose: must be true or false, got 'loud'"),
        (["seed=null"], "seed: must not be null"),
        (["model=mlp", "model.hidden=wide"], "model.hidden: must be an integer, got 'wide'"),
        (["algorithm=bhfl", "algorithm.up.lr=abc"], "algorithm.up.lr: must be a number, got 'abc'"),
        (["algorithm=pfedme", "algorithm.inner_steps=2.5"], "algorithm.inner_steps: must be an integer, got 2.5"),
        (["topology=tree", "topology.fanout=[2,x]"], "topology.fanout[1]: must be an integer, got 'x'"),
        (["global_round=5"], "global_round: no such key; did you mean global_rounds?"),  # never "+global_round=5"
        (["algorithm.alhpa=1"], "algorithm.alhpa: no such key; did you mean algorithm.alpha?"),
        (["topology.fanout=[2,3]"], "topology.fanout: no such key in this topology; it belongs to topology=tree"),
    ],
)
def test_schema_refuses_a_wrong_type_naming_the_key(overrides, message):
    with pytest.raises(ConfigCompositionException) as caught:
        compose_cfg(*overrides)
    error = schema.config_error(caught.value)
    assert isinstance(error, ConfigError)
    assert str(error) == message
    assert error.key == message.split(":")[0]


@pytest.mark.parametrize(
    ("line", "wrong", "message"),
    [
        ("local_steps: 20 ", "local_steps: abc  # ", "algorithm.local_steps: must be an integer, got 'abc' "
                                                     "(in conf/algorithm/permfl.yaml)"),
        ("eta: 0.03 ", "etaa: 0.03  # ", "algorithm.etaa: no such key; did you mean algorithm.eta? "
                                        "(in conf/algorithm/permfl.yaml)"),
    ],
)
def test_schema_refuses_a_wrong_file_naming_the_key_and_the_file(tmp_path, line, wrong, message):
    shutil.copytree(CONF_DIR, tmp_path / "conf")
    permfl = tmp_path / "conf" / "algorithm" / "permfl.yaml"
    permfl.write_text(permfl.read_text().replace(line, wrong, 1))
    schema.register()
    with pytest.raises(ConfigCompositionException) as caught:
        with initialize_config_dir(config_dir=str(tmp_path / "conf"), version_base="1.3"):
            compose("config")
    assert str(schema.config_error(caught.value)) == message


def test_config_error_is_none_for_other_hydra_errors():
    with pytest.raises(Exception) as caught:
        compose_cfg("algorithm=no_such_algorithm")
    assert schema.config_error(caught.value) is None


# ---------------------------------------------------------------- non-finite numbers


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        (["algorithm.lam=nan"], "algorithm.lam", "nan"),
        (["algorithm.alpha=inf"], "algorithm.alpha", "inf"),
        (["algorithm.beta=-inf"], "algorithm.beta", "-inf"),
        (["dataset.dirichlet_alpha=nan"], "dataset.dirichlet_alpha", "nan"),
        (["dataset.size_mean=inf"], "dataset.size_mean", "inf"),
        (["algorithm.min_fit_fraction=nan"], "algorithm.min_fit_fraction", "nan"),
        (["algorithm=bhfl", "algorithm.up.lr=inf"], "algorithm.up.lr", "inf"),
        (["algorithm=bhfl", "+algorithm.levels.1.down={optimizer: sgd, lr: nan}"], "algorithm.levels.1.down.lr", "nan"),
        (["algorithm=bhfl", "algorithm.sample_fraction=[1,nan]"], "algorithm.sample_fraction[1]", "nan"),
        (["algorithm=pfedbayes", "algorithm.rho_offset=-inf"], "algorithm.rho_offset", "-inf"),
        (["algorithm=pflego", "algorithm.server_lr=nan"], "algorithm.server_lr", "nan"),
        (["dataset=mnist", "dataset.normalize=[0.5,inf]"], "dataset.normalize[1]", "inf"),
        (["runtime=deployment", "runtime.team_round_timeout=inf"], "runtime.team_round_timeout", "inf"),
    ],
)
def test_every_non_finite_number_is_refused_naming_the_key(overrides, key, value):
    with pytest.raises(ConfigError) as caught:
        validate(compose_cfg(*overrides))
    assert caught.value.key == key
    assert str(caught.value) == f"{key}: must be a finite number, got {value}"


def test_a_non_finite_number_stops_the_run_before_training(tmp_path):
    cfg = compose_cfg(*SMALL, "runtime=inprocess", "algorithm.gamma=nan")
    with pytest.raises(ConfigError, match=r"^algorithm\.gamma: must be a finite number, got nan$"):
        run(cfg, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "state").exists()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_number_refuses_non_finite_values_whatever_the_bounds(value):
    with pytest.raises(ConfigError, match="must be a finite number"):
        check_number("algorithm.x", value, minimum=-math.inf, maximum=math.inf)
    with pytest.raises(ConfigError, match="must be a finite number"):
        check_number("algorithm.x", value, minimum=0, maximum=1)


def test_a_value_no_config_gave_is_refused_naming_the_key():
    cfg = compose_cfg()
    cfg["algorithm"]["eta"] = MISSING  # what a schema leaves when a YAML file omits its key
    with pytest.raises(ConfigError, match=r"^algorithm\.eta: missing"):
        validate(cfg)


# ---------------------------------------------------------------- hfl-simulate: one line


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("algorithm.local_steps=abc", "hfl-simulate: algorithm.local_steps: must be an integer, got 'abc'"),
        ("algorithm.lam=nan", "hfl-simulate: algorithm.lam: must be a finite number, got nan"),
    ],
)
def test_cli_prints_one_line_naming_the_key(tmp_path, override, line):
    proc = subprocess.run([sys.executable, "-m", "hfl.runtime.simulate", override, f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.strip() == line
    assert "Traceback" not in proc.stdout + proc.stderr


def test_cli_help_lists_the_groups_and_cfg_job_prints_the_composed_config():
    help_text = subprocess.run([sys.executable, "-m", "hfl.runtime.simulate", "--help"], capture_output=True, text=True,
                               timeout=120, cwd=ROOT, check=True).stdout
    # hfl's page (conf/hydra/help/hfl.yaml; tests/test_cli_help.py): the groups users pick, none of schema/*;
    # the composed config is --cfg job's (below).
    assert "  algorithm   permfl* al2gd bhfl " in help_text and "  topology    random* by_label_average " in help_text
    assert "schema" not in help_text and "hfl-simulate --cfg job" in help_text
    job = subprocess.run([sys.executable, "-m", "hfl.runtime.simulate", "algorithm=bhfl", "topology=tree", "--cfg", "job"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout
    assert yaml.safe_load(job) == compose_cfg("algorithm=bhfl", "topology=tree")


# ---------------------------------------------------------------- the schema declares types only


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def yaml_values(group: str, option: str) -> dict:
    """An option's values as its file (and the files it extends in its group) give them."""
    data = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text())
    values: dict = {}
    for entry in data.pop("defaults", []):
        if isinstance(entry, str) and not entry.startswith("/") and entry != "_self_":
            values.update(yaml_values(group, entry))
    return {**values, **data}


GROUPS = ["algorithm", "dataset", "model", "topology", "runtime"]
BASES = {"algorithm": schema.AlgorithmConfig, "dataset": schema.DatasetConfig, "model": schema.ModelConfig,
         "topology": schema.TopologyConfig, "runtime": schema.RuntimeConfig}


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_extends_its_schema_and_keeps_its_values(group, option):
    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"{group}={option}"])
    node = cfg[group]
    node_type = OmegaConf.get_type(node)
    assert issubclass(node_type, BASES[group]), f"{group}/{option}.yaml does not extend a {group} schema"
    # every key typed, none missing: the schema's fields are exactly the file's keys
    assert sorted(f.name for f in dataclasses.fields(node_type)) == sorted(node)
    # conf/'s values, untouched, over the few defaults the schema declares (keys every option has)
    defaults = {f.name: f.default for f in dataclasses.fields(node_type)
                if f.default is not dataclasses.MISSING and f.default != "???"}
    assert OmegaConf.to_container(node) == {**defaults, **yaml_values(group, option)}


# The keys every option of a group has with one engine default: declared with it in the base schema
# (and nowhere in code), so that no file of conf/ repeats it.
ENGINE_DEFAULTS = {schema.AlgorithmConfig: {"sampling", "sample_fraction", "candidates", "level_rounds", "local_labels",
                                            "local_epochs"},
                   schema.RuntimeConfig: {"state_dir", "team_wait_seconds", "verbose"}}


def test_schema_fields_have_no_defaults_of_their_own_but_the_engines():
    classes = [schema.HflConfig, schema.NodeOptConfig, *(c for group in schema.SCHEMAS for c in schema._group_schemas(group))]
    for cls in classes:
        base_defaults = {name for base, names in ENGINE_DEFAULTS.items() if issubclass(cls, base) for name in names}
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                assert all(getattr(default, g.name) == MISSING for g in dataclasses.fields(default)), (cls, f.name)
            elif f.name not in base_defaults:
                assert default == MISSING, f"{cls.__name__}.{f.name} declares a default: conf/ holds the values"
    for base, names in ENGINE_DEFAULTS.items():
        assert all(next(f for f in dataclasses.fields(base) if f.name == name).default != MISSING for name in names)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm=bhfl", "topology=tree", "topology.fanout=[2,3,10]", "algorithm.up.optimizer=adam",
         "algorithm.up.lr=0.01", "algorithm.sample_fraction=[1,1,0.5]", "algorithm.level_rounds=[1,5]"],
        ["algorithm=bhfl", "topology=tree", "topology.fanout=null", "topology.nodes=[[[0,1],[2,3]],[[4,5],[6,7]]]"],
        ["algorithm=bhfl", "+algorithm.levels.0.up={optimizer: adam, lr: 0.01}", "+algorithm.levels.3.down.lr=0.5"],
        ["algorithm=hierfavg", "++algorithm.sample_fraction=[1,0.2]"],
        ["algorithm=pflego", "dataset=mnist", "dataset.partition=roundrobin", "model=mlp", "model.hidden=8",
         "dataset.normalize=[0,1]"],
        ["experiment=permfl_mnist_mclr", "dataset.normalize=per_feature", "topology=by_label_worst"],
        ["algorithm=fedavg", "algorithm.sampling=devices", "algorithm.sample_fraction=0.2"],
        ["runtime=deployment", "runtime.team_round_timeout=45"],
    ],
)
def test_the_repos_overrides_still_compose(overrides):
    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        schema.check_keys(compose("config", overrides=overrides))  # the keys they add (+, ++) are read


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (["algorithm.personalized=false"], "ServerRule.personalized"),  # an override: refused while composing
        (["algorithm=pflego", "++algorithm.pm_base=own"], "PflegoServer.pm_base"),  # ++: refused by check_keys
        (["algorithm=hierfavg", "++algorithm.any_depth=false"], "FedAvgServer.any_depth"),
        (["algorithm=fedrep", "++algorithm.batched=true"], "FedRepClient.batched"),  # the device client's
    ],
)
def test_an_algorithms_nature_is_no_setting(overrides, rule):
    """What an algorithm is (hfl.config.schema.NATURE_KEYS) is its rule's class attribute: a config
    that sets it is refused naming the attribute."""
    key = overrides[-1].lstrip("+").split("=")[0]
    schema.register()
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}: is the algorithm's nature \({rule}\)"):
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                schema.check_keys(compose("config", overrides=overrides))
        except ConfigError:
            raise
        except Exception as exc:  # Hydra's error for an override of a key the schema lacks
            raise schema.config_error(exc) or exc


def test_floats_accept_integers():
    assert compose_cfg("algorithm.alpha=1")["algorithm"]["alpha"] == 1.0


def test_register_is_idempotent():
    schema.register()
    schema.register()
    assert compose_cfg()["algorithm"]["name"] == "permfl"
