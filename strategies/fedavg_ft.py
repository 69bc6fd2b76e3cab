"""FedAvg+ servers (FeMAM's baseline): FedAvg's, which also send the devices their fine-tuning
settings (``finetune_epochs``, ``finetune_lr``) with every training round.

Aggregation is ``strategies.fedavg``'s, unchanged: a run of ``fedavg_ft`` trains the same models
as ``fedavg`` with the same seed. What differs is evaluation only (``clients.fedavg_ft``): the
devices test the global model after fine-tuning it on their own training split.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from omegaconf import MISSING

from strategies.fedavg import FedAvgConfig
from hfl.errors import ConfigError
from hfl.rules.personal import check_keys
from strategies.fedavg import FedAvgServer


@dataclass
class FedAvgFtConfig(FedAvgConfig):
    """FedAvg+ (FedAvg, then each device fine-tunes the global model before testing it)."""

    finetune_epochs: int = MISSING
    finetune_lr: float = MISSING


class FedAvgFTServer(FedAvgServer):
    schema = FedAvgFtConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    personalized = True  # PM = the global model, fine-tuned by each device
    pm_base = "gm"  # evaluation sends the GM as the PM's base (clients/fedavg_ft.py)
    keys = ("finetune_epochs", "finetune_lr")

    @classmethod
    def check_config(cls, alg: Mapping[str, Any]) -> None:
        check_fine_tuning(alg)


SERVER = FedAvgFTServer


def check_fine_tuning(alg: Mapping[str, Any]) -> None:
    check_keys(alg, finetune_epochs={"integer": True, "minimum": 0}, finetune_lr={"minimum": 0, "open_min": True})
    # A device learns its fine-tuning settings from its training rounds (the evaluation message
    # carries only the model): one never asked to train would have none to test with.
    fraction = alg["sample_fraction"]
    if any(float(f) < 1 for f in (fraction if isinstance(fraction, list | tuple) else [fraction])):
        raise ConfigError("algorithm.sample_fraction", "FedAvg+ needs every device in every round (each learns its "
                                                       "fine-tuning settings from its training rounds); "
                                                       f"got {fraction!r}")
