"""hfl.config.typed: a composed section as its schema's dataclass, what every rule reads
(``NodeContext.params``): every key by attribute with its composed value, and a one-line error
naming the key for a section that was not composed against the schema."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hfl.config.schema import NodeOptConfig
from hfl.config.typed import algorithm_params, typed
from hfl.errors import ConfigError
from strategies.bhfl import BHFLConfig
from strategies.permfl import PerMFLConfig
from tests.conftest import compose_cfg

ALGORITHMS = sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "algorithm").glob("*.yaml"))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_file_reads_back_as_its_rules_schema(name):
    alg = compose_cfg(f"algorithm={name}")["algorithm"]
    params = algorithm_params(alg)
    from hfl.config.checks import load_server

    assert type(params) is load_server(alg).schema
    as_dict = dataclasses.asdict(params)
    assert as_dict == alg  # every composed key, nothing more, nested optimisers included


def test_nested_sections_are_their_dataclasses_and_overrides_arrive():
    alg = compose_cfg("algorithm=bhfl", "algorithm.up.lr=0.25", "algorithm.alpha=1")["algorithm"]
    params = algorithm_params(alg)
    assert isinstance(params.up, NodeOptConfig) and params.up.lr == 0.25
    assert params.alpha == 1.0 and isinstance(params.alpha, float)


def permfl_keys() -> dict:
    return compose_cfg("algorithm=permfl")["algorithm"]


def test_a_key_the_schema_lacks_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"^algorithm\.residual_up_k: is not a key of PerMFLConfig"):
        typed(PerMFLConfig, {**permfl_keys(), "residual_up_k": 1}, "algorithm")


def test_a_missing_key_is_refused_naming_it():
    keys = permfl_keys()
    del keys["lam"]
    with pytest.raises(ConfigError, match=r"^algorithm\.lam: PerMFLConfig needs it"):
        typed(PerMFLConfig, keys, "algorithm")


def test_an_engine_default_fills_a_key_the_file_need_not_repeat():
    keys = permfl_keys()
    del keys["candidates"]  # AlgorithmConfig's engine default
    assert typed(PerMFLConfig, keys, "algorithm").candidates == 0


@pytest.mark.parametrize(("key", "value", "kind"), [("lam", "2", "a number"), ("local_steps", 2.5, "an integer"),
                                                    ("local_steps", True, "an integer"), ("prox_slip", 1, "true or false"),
                                                    ("name", 3, "a string")])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(key, value, kind):
    with pytest.raises(ConfigError, match=rf"^algorithm\.{key}: must be {kind}"):
        typed(PerMFLConfig, {**permfl_keys(), key: value}, "algorithm")


def test_a_nested_key_is_named_with_its_section():
    alg = compose_cfg("algorithm=bhfl")["algorithm"]
    del alg["down"]["lr"]
    with pytest.raises(ConfigError, match=r"^algorithm\.down\.lr: NodeOptConfig needs it"):
        typed(BHFLConfig, alg, "algorithm")


def test_optional_keys_take_null():
    alg = compose_cfg("algorithm=bhfl", "algorithm.proxy_samples=null")["algorithm"]
    assert algorithm_params(alg).proxy_samples is None
