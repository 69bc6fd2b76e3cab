"""Invalid configurations stop the run before training, naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException

from hfl.errors import ConfigError, DatasetNotFoundError
from hfl.runtime.simulate import run
from tests.conftest import SMALL, compose_cfg


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algorithm.alpha=-0.1", "algorithm.alpha"),
        ("algorithm.eta=-1", "algorithm.eta"),
        ("algorithm.team_rounds=0", "algorithm.team_rounds"),
        ("global_rounds=0", "global_rounds"),
        ("dataset.batch_size=0", "dataset.batch_size"),
        ("algorithm.weighted=maybe", "algorithm.weighted"),
        ("algorithm.min_fit_fraction=1.5", "algorithm.min_fit_fraction"),
        ("algorithm.strategy=strategies.nope", "algorithm.strategy"),
        ("runtime.torch_threads=0", "runtime.torch_threads"),
        ("runtime.batched_threads=0", "runtime.batched_threads"),
        ("topology.devices_per_team=0", "topology.devices_per_team"),
        ("dataset.train_fraction=1.5", "dataset.train_fraction"),
        ("model.name=resnet", "model.name"),
    ],
)
def test_bad_value_names_its_key(override, key, tmp_path):
    cfg = compose_cfg(*SMALL, "runtime=inprocess", override)
    with pytest.raises(ConfigError, match=key) as info:
        run(cfg, tmp_path)
    assert info.value.key.startswith(key)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained


def test_explicit_teams_must_agree_with_num_teams(tmp_path):
    cfg = compose_cfg(*SMALL, "runtime=inprocess", "topology.formation=explicit",
                      "topology.teams=[[0],[1]]", "topology.num_teams=3", "topology.devices_per_team=null")
    with pytest.raises(ConfigError, match="topology"):
        run(cfg, tmp_path)


def test_unreadable_root_says_where_it_looked(tmp_path):
    cfg = compose_cfg("runtime=inprocess", "dataset=mnist", f"dataset.root={tmp_path / 'nowhere'}")
    with pytest.raises((ConfigError, DatasetNotFoundError), match="nowhere"):
        run(cfg, tmp_path / "out")


def test_unknown_group_option_is_a_hydra_error():
    with pytest.raises(HydraException, match="algorithm"):
        compose_cfg("algorithm=no_such_algorithm")


def test_cli_exits_nonzero_naming_the_key(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hfl.runtime.simulate", "algorithm.lam=-2", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1],
    )
    assert proc.returncode != 0
    assert "algorithm.lam" in proc.stderr + proc.stdout


@pytest.mark.parametrize("experiment", ["permfl_mnist_mclr", "permfl_synthetic_mclr"])
def test_presets_are_the_full_papers_setting_and_combine_with_table2_teams(experiment):
    cfg = compose_cfg(f"experiment={experiment}")
    alg = cfg["algorithm"]
    assert (alg["name"], alg["team_rounds"], alg["local_steps"], alg["weighted"]) == ("permfl", 10, 20, False)
    assert (alg["alpha"], alg["eta"], alg["lam"], alg["gamma"], alg["beta"]) == (0.01, 0.03, 0.5, 1.5, 0.6)
    assert cfg["dataset"]["batch_size"] == 124
    assert (cfg["topology"]["num_teams"], cfg["topology"]["devices_per_team"]) == (4, 10)
    worst = compose_cfg(f"experiment={experiment}", "topology=by_label_worst")
    assert worst["topology"]["num_teams"] == 2 and worst["algorithm"]["lam"] == 0.5


@pytest.mark.parametrize(("algorithm", "defined"), [("permfl", False), ("pfedme", False), ("fedavg", True),
                                                    ("pflego", True)])
def test_a_deeper_tree_follows_the_rules_any_depth(algorithm, defined):
    """Whether an algorithm runs on a tree deeper than three tiers is its rule's class attribute
    (ServerRule.any_depth), not a config key: a deeper tree is refused naming topology.fanout."""
    from hfl.config.checks import load_server
    from hfl.runtime.build import check_tree, federation_for

    cfg = compose_cfg(f"algorithm={algorithm}", "topology=tree", "topology.fanout=[2,2,3]", "dataset.max_samples=300",
                      *(["dataset.partition=roundrobin"] if algorithm == "pflego" else []))
    assert load_server(cfg["algorithm"]).any_depth is defined
    if defined:
        check_tree(cfg, federation_for(cfg).tree)
    else:
        with pytest.raises(ConfigError, match=r"topology\.fanout: .*defined for three tiers"):
            check_tree(cfg, federation_for(cfg).tree)
