"""FedAvg on the tree: every server takes the (sample-weighted) mean of its children's models.

With K = 1 (``algorithm=fedavg``) the means of every level compose into flat FedAvg over all
devices; with K > 1 at the lowest servers (``algorithm=hierfavg``) it is h-SGD / HierFAVG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from flwr.common import NDArrays, Scalar
from omegaconf import MISSING

from hfl.algorithm import NodeContext, Replies, ServerRule
from hfl.config.schema import HierFAVGConfig
from hfl.rules.fit_testing import DevicesOwnTest


@dataclass
class FedAvgConfig(HierFAVGConfig):
    """FedAvg's keys (conf/algorithm/fedavg.yaml), registered as /schema/algorithm/fedavg from here."""

    local_labels: bool = MISSING
    fit_test: bool = MISSING
    sampling: str = MISSING  # children | devices
    sample_fraction: Any = MISSING  # a number or a list, root first


class FedAvgServer(DevicesOwnTest, ServerRule):
    """The weighted mean at every node; devices also get ``algorithm.<key>`` for each of ``keys``."""

    schema = FedAvgConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    keys: ClassVar[tuple[str, ...]] = ()
    merges_replies = True
    any_depth = True  # sample-weighted means compose exactly on any tree

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self._load_fit_test(ctx.state, ctx.is_root)  # with fit_test: the PFLEGO paper's figure (hfl.rules.fit_testing)

    def fit_config(self) -> dict[str, Scalar]:
        p = self.params
        # fit_test is a key of FedAvgConfig's descendants; the rules reusing this one with a schema of
        # their own (pFedMe, DemLearn, Ditto, ...) have no such key and never test what they trained.
        return {"alpha": p.alpha, "local_steps": p.local_steps, "fit_test": getattr(p, "fit_test", False),
                **{key: getattr(p, key) for key in self.keys}}

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        self._record_fit_test(replies)
        return replies.mean(bool(self.params.weighted))

    def state(self) -> dict[str, np.ndarray]:
        return self._fit_test_state()

    def evaluation_metrics(self, model: NDArrays) -> dict[str, float]:
        return self._fit_test_metrics()


SERVER = FedAvgServer
