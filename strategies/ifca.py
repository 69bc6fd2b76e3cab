"""IFCA (Ghosh, Chung, Yin and Ramchandran, "An Efficient Framework for Clustered Federated
Learning", NeurIPS 2020), model averaging, on a tree of any depth.

The root owns K cluster models. Every round each sampled device receives all K, picks the one
with the lowest loss on its training data and trains it (clients.ifca); the new model of
cluster k is the sample-weighted mean of the models of the devices that picked k, and a cluster
nobody picked keeps its model. Inner nodes make the means compose: each replies with its
per-cluster means and the weight behind each (``counts``), so the root's means are the flat
ones whatever the tree (up to float summation order).

A message down is a ``parts`` payload: ``model`` is cluster 0 (so replies, one model each,
are checked against it), ``c1`` ... ``c{K-1}`` the others. Evaluation sends them as ``ctx_c<k>``
parts, which every device completes its personal model from (the cluster it would pick).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.common import NDArrays, Scalar
from omegaconf import MISSING

from hfl.algorithm import Message, NodeContext, Replies, ServerRule, Update, model_from_state
from hfl.config.schema import HierFAVGConfig
from hfl.device.training import LocalTrainer, to_ndarrays
from hfl.errors import ConfigError
from hfl.models import build_model
from hfl.rules.aggregate import mean_of
from hfl.rules.payload import pack
from hfl.rules.personal import check_keys
from hfl.data.labels import model_classes
from hfl.seed import derive_seed

COUNTS = "counts"  # an inner node's reply part: the weight behind each cluster's mean


@dataclass
class IfcaConfig(HierFAVGConfig):
    """IFCA's keys (conf/algorithm/ifca.yaml), registered as /schema/algorithm/ifca."""

    num_clusters: int = MISSING  # K


# ---------------------------------------------------------------- rules (pure)
def cluster_part(k: int) -> str:
    """The part cluster k travels in: cluster 0 is the payload's ``model``."""
    return "model" if k == 0 else f"c{k}"


def entries(updates: Sequence[Update], num_clusters: int, weighted: bool) -> Iterator[tuple[int, NDArrays, float]]:
    """(cluster, model, weight) of every accepted reply: a device's trained model under the
    cluster it picked (weight: its samples, or 1 unweighted), or each per-cluster mean of a
    child node with the weight behind it."""
    for u in updates:
        if "cluster" in u.metrics:
            k = int(u.metrics["cluster"])
            if not 0 <= k < num_clusters:
                raise ValueError(f"device {u.metrics.get('device_id')} picked cluster {k}; there are {num_clusters}")
            yield k, u.model, float(u.num_examples if weighted else 1)
        else:
            counts = u.parts[COUNTS][0]
            for k in range(num_clusters):
                yield k, u.parts[cluster_part(k)], float(counts[k])


def cluster_means(found: Sequence[tuple[int, NDArrays, float]], previous: Sequence[NDArrays]
                  ) -> tuple[list[NDArrays], np.ndarray]:
    """Each cluster's weighted mean of the models that picked it, and the total weight behind
    it; a cluster with no weight keeps its previous model."""
    means, counts = [], np.zeros(len(previous), dtype=np.float64)
    for k, before in enumerate(previous):
        members = [(model, w) for c, model, w in found if c == k and w > 0]
        counts[k] = sum(w for _, w in members)
        means.append(mean_of([m for m, _ in members], [w for _, w in members]) if members else list(before))
    return means, counts


def initial_clusters(ctx: NodeContext, first: NDArrays, num_clusters: int) -> list[NDArrays]:
    """Cluster 0 is the run's initial model; cluster k >= 1 a fresh model of the configured
    architecture, seeded by (seed, "ifca-init", k)."""
    out = [list(first)]
    for k in range(1, num_clusters):
        torch.manual_seed(derive_seed(ctx.run.seed, "ifca-init", k))
        model = build_model(ctx.run.model, ctx.fed.input_shape, model_classes(ctx.params.local_labels, ctx.fed))
        out.append(to_ndarrays(LocalTrainer(model).initial_params()))
    return out


# ---------------------------------------------------------------- the server
class IfcaServer(ServerRule):
    """Every node: per-cluster weighted means of its children's replies. The root keeps the K
    models (cluster 0 as its model, the others in its stored state)."""

    schema = IfcaConfig
    personalized = True  # PM = the cluster model a device picks (by its training loss)
    global_model = False  # K models, none of them the global one
    level_models = False  # servers hold per-cluster sums, no model of their own
    any_depth = True  # per-cluster weighted means compose up the tree

    @classmethod
    def check_config(cls, alg: Mapping[str, Any]) -> None:
        check_keys(alg, num_clusters={"integer": True, "minimum": 1})

    @classmethod
    def check_federation(cls, cfg: Mapping[str, Any], fed: Any) -> None:
        # Each device joins one cluster: with more clusters than devices some are never trained.
        k, devices = int(cfg["algorithm"]["num_clusters"]), fed.tree.num_devices
        if k > devices:
            raise ConfigError("algorithm.num_clusters", f"must be in [1, {devices}] (one cluster per device at most: "
                                                        f"this federation has {devices} devices), got {k}")

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.k = ctx.params.num_clusters
        if ctx.is_root:
            first = model_from_state(ctx.state)  # a resumed run: the models the root stored
            if first is None:
                self.clusters = initial_clusters(ctx, ctx.payload.main, self.k)
            else:
                self.clusters = [first] + [[ctx.state[f"c{k}.{i}"] for i in range(len(first))] for k in range(1, self.k)]
        else:
            self.clusters = [ctx.payload.parts[cluster_part(k)] for k in range(self.k)]
        self.counts = np.zeros(self.k, dtype=np.float64)

    def start(self) -> NDArrays:
        return self.clusters[0]

    def fit_config(self) -> dict[str, Scalar]:
        return {"alpha": self.params.alpha, "local_steps": self.params.local_steps}

    def fit_message(self, rnd: int, model: NDArrays) -> Message:
        self.clusters[0] = model
        return pack("parts", {cluster_part(k): m for k, m in enumerate(self.clusters)})

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        found = list(entries(replies.updates, self.k, bool(self.params.weighted)))
        self.clusters, self.counts = cluster_means(found, self.clusters)
        return self.clusters[0]

    def reply_parts(self) -> dict[str, NDArrays]:
        return {**{cluster_part(k): self.clusters[k] for k in range(1, self.k)}, COUNTS: [self.counts]}

    def state(self) -> dict[str, np.ndarray]:
        if not self.ctx.is_root:
            return {}
        return {f"c{k}.{i}": a for k in range(1, self.k) for i, a in enumerate(self.clusters[k])}

    def evaluation_message(self, model: NDArrays) -> Message:
        return pack("parts", {f"ctx_c{k}": m for k, m in enumerate(self.clusters)})

    def evaluation_metrics(self, model: NDArrays) -> dict[str, float]:
        """How many clusters the devices picked in the last round."""
        return {"ifca_clusters_used": float(np.count_nonzero(self.counts))}


SERVER = IfcaServer
