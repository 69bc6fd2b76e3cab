"""FedAvg on the tree: every server takes the (sample-weighted) mean of its children's models.

With K = 1 (``algorithm=fedavg``) the means of every level compose into flat FedAvg over all
devices; with K > 1 at the lowest servers (``algorithm=hierfavg``) it is h-SGD / HierFAVG.
"""

from __future__ import annotations

from typing import ClassVar

from flwr.common import NDArrays, Scalar

from hfl.algorithm import Replies, ServerRule


class FedAvgServer(ServerRule):
    """The weighted mean at every node; devices also get ``algorithm.<key>`` for each of ``keys``."""

    keys: ClassVar[tuple[str, ...]] = ()
    merges_replies = True
    any_depth = True  # sample-weighted means compose exactly on any tree

    def fit_config(self) -> dict[str, Scalar]:
        alg = self.alg
        return {"alpha": alg["alpha"], "local_steps": alg["local_steps"], "fit_test": bool(alg.get("fit_test", False)),
                **{key: alg[key] for key in self.keys}}

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        return replies.mean(bool(self.alg["weighted"]))


SERVER = FedAvgServer
