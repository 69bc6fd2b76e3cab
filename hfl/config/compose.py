"""The run's configuration composed from ``conf/`` and Hydra overrides, outside ``hfl-simulate``
(which composes through ``@hydra.main``): ``flwr run .``'s apps from the run config's
``overrides`` string, ``hfl-deploy`` and the tests."""

from __future__ import annotations

import shlex
import tempfile
from functools import lru_cache
from pathlib import Path

from flwr.common import Context

from hfl.config import schema
from hfl.config.checks import validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
schema.register()  # conf/'s files extend the schemas: whoever composes from CONF_DIR needs them stored


@lru_cache(maxsize=4)
def compose_config(overrides: str, run_id: int) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    schema.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose("config", overrides=shlex.split(overrides))
        schema.check_keys(composed)  # a key nothing reads (a misspelt +key) is refused like a bad value
        cfg = OmegaConf.to_container(composed, resolve=True)
    validate(cfg)
    # runtime.state_dir (a directory every Ray node mounts) or this machine's temp dir; a folder per run
    base = cfg["runtime"]["state_dir"] or tempfile.gettempdir()
    cfg["runtime"]["state_dir"] = str(Path(base) / f"hfl-state-{run_id}")
    return cfg


def context_config(context: Context) -> dict:
    """The config of a Flower app's run: its run config's ``overrides``, composed once per run."""
    return compose_config(str(context.run_config.get("overrides", "")), context.run_id)
