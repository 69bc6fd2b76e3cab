"""A device's own data file (``--data-path``), checked before its SuperNode connects: a file a
node server would only find wrong at its first message (or train on silently, cut to the
shorter of x and y) is refused at start, naming the file and what is wrong."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

KEYS = ("x_train", "y_train", "x_test", "y_test", "num_classes")


def data_file_problem(path: str | Path) -> str | None:
    """What is wrong with a device data file (npz: x_train, y_train, x_test, y_test, num_classes),
    or None."""
    path = Path(path)
    if not path.is_file():
        return "no such file"
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in KEYS if k not in f.files]
            if missing:
                return f"lacks {', '.join(missing)} (it needs {', '.join(KEYS)})"
            arrays = {k: f[k] for k in KEYS}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        return f"cannot be read as npz ({exc})"
    classes = arrays["num_classes"]
    if classes.shape != () or not np.issubdtype(classes.dtype, np.integer) or int(classes) < 2:
        return f"num_classes must be one integer >= 2, got {classes.tolist()!r}"
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)) or x.ndim < 2:
            return f"x_{split} must be a numeric array of samples x features, got {x.dtype} of shape {x.shape}"
        if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
            return f"y_{split} must be a 1-D integer array of labels, got {y.dtype} of shape {y.shape}"
        if len(x) != len(y):
            return f"x_{split} has {len(x)} samples but y_{split} {len(y)} labels"
        if len(y) and (y.min() < 0 or y.max() >= int(classes)):
            return f"y_{split} holds labels outside 0..{int(classes) - 1} (num_classes {int(classes)})"
        if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
            return f"x_{split} holds NaN or infinite values"
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        return f"x_train's samples are {arrays['x_train'].shape[1:]} but x_test's {arrays['x_test'].shape[1:]}"
    if len(arrays["y_train"]) == 0:
        return "x_train holds no sample"
    return None


def check_data_file(path: str | Path) -> None:
    """Raise ``ValueError("device data PATH: PROBLEM")`` if the file is unusable."""
    problem = data_file_problem(path)
    if problem is not None:
        raise ValueError(f"device data {path}: {problem}")
