"""What a message carries, declared: a payload kind and, for named parts, their layout.

Flower's ``NumPyClient`` messages hold one flat list of arrays plus a config/metrics dict.
``pack`` flattens named parts into that list and declares the kind and layout in the dict
(``payload``, ``parts``); ``unpack`` inverts it. A message that declares nothing is one
model (every device client and every Flower strategy speaks that), so the declaration is
only needed where a message is something else:

- ``model``: one model (the default);
- ``delta``: a model difference; ``gradient``: a gradient sum (PFLEGO);
- ``parts``: several named models or sums (e.g. the models to evaluate: ``gm``, ``level1``…,
  or a model plus residual updates for an ancestor);
- ``empty``: nothing to aggregate (an unsampled subtree); it is neither a failure nor a rejection.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from flwr.common import NDArrays, Parameters, Scalar, ndarray_to_bytes, parameters_to_ndarrays

KINDS = ("model", "delta", "gradient", "parts", "empty")
MAIN = "model"  # the part that single-array kinds are stored under


@dataclass
class Payload:
    kind: str
    parts: dict[str, NDArrays] = field(default_factory=dict)

    @property
    def main(self) -> NDArrays:
        """The arrays of a single-array kind (or of the ``model`` part)."""
        if MAIN not in self.parts:
            raise KeyError(f"a {self.kind!r} payload has no {MAIN!r} part (parts: {sorted(self.parts)})")
        return self.parts[MAIN]


def pack(kind: str, parts: Mapping[str, NDArrays] | NDArrays | None = None) -> tuple[NDArrays, dict[str, Scalar]]:
    """Arrays and the config/metrics entries that declare them. Single-array kinds take a
    list of arrays; ``parts`` takes a name -> arrays mapping; ``empty`` takes nothing."""
    if kind not in KINDS:
        raise ValueError(f"unknown payload kind {kind!r}; known: {', '.join(KINDS)}")
    if kind == "empty":
        if parts:
            raise ValueError("an empty payload carries no arrays")
        return [], {"payload": "empty"}
    if kind != "parts":
        if isinstance(parts, Mapping):
            raise ValueError(f"a {kind!r} payload is one list of arrays, not named parts")
        return list(parts or []), {"payload": kind}
    if not isinstance(parts, Mapping):
        raise ValueError("a 'parts' payload needs a name -> arrays mapping")
    layout = [[name, len(arrays)] for name, arrays in parts.items()]
    flat = [a for arrays in parts.values() for a in arrays]
    return flat, {"payload": "parts", "parts": json.dumps(layout)}


def unpack(arrays: NDArrays, meta: Mapping[str, Scalar]) -> Payload:
    """The payload ``arrays`` + ``meta`` declare (no declaration: one model)."""
    kind = str(meta.get("payload", MAIN))
    if kind not in KINDS:
        raise ValueError(f"unknown payload kind {kind!r}; known: {', '.join(KINDS)}")
    if kind == "empty":
        if len(arrays):
            raise ValueError(f"an empty payload came with {len(arrays)} arrays")
        return Payload("empty")
    if kind != "parts":
        return Payload(kind, {MAIN: list(arrays)})
    layout = json.loads(str(meta.get("parts", "[]")))
    if sum(n for _, n in layout) != len(arrays):
        raise ValueError(f"a parts payload declares {sum(n for _, n in layout)} arrays but carries {len(arrays)}")
    parts, start = {}, 0
    for name, n in layout:
        parts[str(name)] = list(arrays[start : start + n])
        start += n
    return Payload("parts", parts)


class LocalParameters(Parameters):
    """Flower ``Parameters`` (the serialized bytes, which bytes counters measure) that also keep
    the arrays they encode: a reply that never left the process (a batched device's) is read
    back without decoding (``decode``); 700 decodes cost ~0.4 s a team round."""

    def __init__(self, arrays: NDArrays) -> None:
        super().__init__(tensors=[ndarray_to_bytes(a) for a in arrays], tensor_type="numpy.ndarray")
        self.arrays = list(arrays)


def decode(parameters: Parameters) -> NDArrays:
    """The arrays of ``parameters``: kept ones where it holds them, else Flower's decoding."""
    if isinstance(parameters, LocalParameters):
        return list(parameters.arrays)
    return parameters_to_ndarrays(parameters)
