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

import numpy as np
from flwr.common import NDArrays, Parameters, Scalar, ndarray_to_bytes, parameters_to_ndarrays

from hfl.rules.aggregate import nbytes

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


_NPY_HEADER: dict[tuple, int] = {}


def npy_nbytes(array: np.ndarray) -> int:
    """``len(ndarray_to_bytes(array))`` without encoding it: Flower's encoding is NumPy's .npy
    format, whose header depends only on the dtype, shape and memory order (measured once per
    kind by encoding one array)."""
    key = (array.dtype, array.shape, bool(array.flags.f_contiguous and not array.flags.c_contiguous))
    if key not in _NPY_HEADER:
        _NPY_HEADER[key] = len(ndarray_to_bytes(array)) - array.nbytes
    return _NPY_HEADER[key] + array.nbytes


class LocalParameters(Parameters):
    """Flower ``Parameters`` that keep the arrays they encode and encode them only when their
    bytes are read: a reply that never leaves the process (a batched device's) is read back
    without decoding (``decode``) and counted without encoding (``payload_nbytes``); 700
    encodings cost ~0.1 s a team round, as many decodes ~0.4 s. The arrays are made read-only,
    so the bytes, whenever made, are those of the reply."""

    def __init__(self, arrays: NDArrays) -> None:  # noqa: D107 - no call to Parameters.__init__: no bytes yet
        self.arrays = list(arrays)
        self.tensor_type = "numpy.ndarray"
        self._tensors: list[bytes] | None = None
        for a in self.arrays:
            if isinstance(a, np.ndarray):
                a.flags.writeable = False

    @property  # type: ignore[override]
    def tensors(self) -> list[bytes]:
        if self._tensors is None:
            self._tensors = [ndarray_to_bytes(a) for a in self.arrays]
        return self._tensors

    @tensors.setter
    def tensors(self, value: list[bytes]) -> None:
        self._tensors = list(value)

    def nbytes(self) -> int:
        """The bytes ``tensors`` hold (or will), without encoding the arrays."""
        if self._tensors is not None:
            return nbytes(self._tensors)
        return sum(npy_nbytes(a) for a in self.arrays)


def payload_nbytes(parameters: Parameters) -> int:
    """Bytes of ``parameters`` as sent (the bytes counters): ``LocalParameters`` without encoding."""
    return parameters.nbytes() if isinstance(parameters, LocalParameters) else nbytes(parameters.tensors)


def decode(parameters: Parameters) -> NDArrays:
    """The arrays of ``parameters``: kept ones where it holds them, else Flower's decoding."""
    if isinstance(parameters, LocalParameters):
        return list(parameters.arrays)
    return parameters_to_ndarrays(parameters)
