from __future__ import annotations

import functools
import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hfl.config import schema
from hfl.config.compose import CONF_DIR

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

# A small, fast federation: 2 teams x 3 devices of synthetic data, short rounds.
SMALL = [
    "topology.num_teams=2",
    "topology.devices_per_team=3",
    "dataset.max_samples=300",
    "global_rounds=3",
    "algorithm.team_rounds=2",
    "algorithm.local_steps=5",
    "algorithm.alpha=0.05",
    "dataset.batch_size=32",
    "runtime.torch_threads=1",
]


def compose_cfg(*overrides: str) -> dict:
    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


@pytest.fixture
def small_cfg():
    def make(*overrides: str) -> dict:
        return compose_cfg(*SMALL, *overrides)

    return make


@functools.cache
def _algorithm_file(name: str) -> dict:
    return compose_cfg(f"algorithm={name}")["algorithm"]


def rule_context(server, alg: dict, path: str, depth: int, payload, state=None, fed=None, cfg=None):  # noqa: ANN001, ANN201
    """A ``NodeContext`` for ``server`` (a ServerRule class) whose algorithm keys are ``alg`` over
    those of the file named like the rule's module (``strategies.permfl``: conf/algorithm/permfl.yaml),
    typed by its schema as the engine types them; the run's settings from ``cfg`` when given."""
    from hfl.algorithm import NodeContext, RunSettings
    from hfl.config.typed import typed

    full = {**_algorithm_file(server.__module__.rsplit(".", 1)[-1]), **alg}
    run = RunSettings.of(cfg) if cfg is not None else RunSettings(seed=0, global_rounds=1, model={}, batch_size=1)
    return NodeContext(typed(server.schema, full, "algorithm"), run, path, depth, payload, state, fed)


def node_strategy(server, parent, alg: dict, *, path: str = "0", depth: int = 2):  # noqa: ANN001, ANN201
    """An inner node's Flower strategy over ``server`` (a ServerRule class), built from its
    parent's model alone, as a call of the node would build it."""
    from hfl.rules.payload import Payload
    from hfl.node.strategy import NodeStrategy

    ctx = rule_context(server, alg, path, depth, Payload("model", {"model": parent}))
    return NodeStrategy(server(ctx), float(ctx.params.min_fit_fraction))


def root_strategy(server, initial, alg: dict, store_dir, **common):  # noqa: ANN001, ANN201
    """The root's Flower strategy over ``server``, its state in a store at ``store_dir``."""
    from hfl.rules.payload import Payload
    from hfl.node.root import RootStrategy
    from hfl.state.store import StateStore

    def make_rule(state):  # noqa: ANN001, ANN202
        return server(rule_context(server, alg, "", 2, Payload("model", {"model": initial}), state))

    return RootStrategy(make_rule, StateStore(store_dir), **common)
