"""A composed config section as the schema's dataclass (hfl.config.schema): what rules and the
engine read, by attribute, typed, after Hydra has composed and ``hfl.config.checks.validate`` has
checked the run.

The run travels as a JSON-like dict (to Ray actors, to deployment hosts, in ``run.json``); a
section is turned into its dataclass where it is used, from that dict. A key the schema lacks,
or a schema key the section lacks, is a ``ConfigError`` naming it: both mean the section was
not composed against this schema (a hand-made config, or an algorithm file naming another
algorithm's schema), and a rule must not run on a guess.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import MISSING

from hfl.errors import ConfigError

T = TypeVar("T")


@functools.cache
def _fields(schema: type) -> tuple[tuple[str, Any, Any], ...]:
    """(name, type, default) of each field; ``MISSING`` where the schema declares no default."""
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING)
        out.append((f.name, hints[f.name], default))
    return tuple(out)


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _scalar(kind: Any, value: Any, key: str) -> Any:
    """``value`` checked against a scalar field's type (``Optional`` ones take None too); an
    integer is a float where a float is declared, as OmegaConf makes it. Other kinds pass as they are."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union and type(None) in args:
        if value is None:
            return None
        rest = [a for a in args if a is not type(None)]
        kind = rest[0] if len(rest) == 1 else Any
    if kind not in _SCALARS:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(key, f"must be {_SCALARS[kind]}, got {value!r}")
    return value


def typed(schema: type[T], section: Mapping[str, Any], where: str) -> T:
    """``section`` (a composed config section, e.g. ``cfg["algorithm"]``) as an instance of
    ``schema``, nested dataclass fields included; ``where`` names the section in errors."""
    fields = _fields(schema)
    names = {name for name, _, _ in fields}
    unknown = sorted(set(section) - names)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"is not a key of {schema.__name__} (the schema this section "
                                                   "is read with); was it composed from another file?")
    values = {}
    for name, kind, default in fields:
        if name in section:
            value = section[name]
        elif default is not MISSING:
            value = default
        else:
            raise ConfigError(f"{where}.{name}", f"{schema.__name__} needs it and the config does not set it")
        if value == MISSING:
            raise ConfigError(f"{where}.{name}", "is ??? (missing): set it in the config file or as an override")
        if dataclasses.is_dataclass(kind) and isinstance(value, Mapping):
            value = typed(kind, value, f"{where}.{name}")
        values[name] = _scalar(kind, value, f"{where}.{name}")
    return schema(**values)


def algorithm_params(alg: Mapping[str, Any]) -> Any:
    """``cfg["algorithm"]`` typed by its rule's schema (``ServerRule.schema``; the base
    ``AlgorithmConfig`` for a rule that declares none): what ``NodeContext.params`` holds."""
    from hfl.config.checks import load_server
    from hfl.config.schema import AlgorithmConfig

    return typed(load_server(alg).schema or AlgorithmConfig, alg, "algorithm")
