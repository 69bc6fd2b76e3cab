"""A node's Flower ``Strategy`` over its children, driving the algorithm's ``ServerRule``
(hfl.algorithm): the children's replies are checked (shapes, NaN/Inf, counts), ordered so that
float sums do not depend on arrival order, and handed to the rule; the rule's model goes on
to the next round. The same class runs the root's rounds (hfl.node.root.RootStrategy holds one per
global round), its children's replies ordered by their level-1 index.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from flwr.common import FitIns, FitRes, NDArrays, Parameters, Scalar
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from hfl.rules.aggregate import all_finite, update_problem
from hfl.device.client import NODE_ROUND
from hfl.algorithm import Replies, ServerRule, Update
from hfl.node.privacy import NodePrivacy
from hfl.rules.payload import LocalParameters, Payload, decode, unpack
from hfl.tree.shape import path_order

log = logging.getLogger(__name__)

# A node's reply names the level-1 node above it (its index; -1 at the root): the root orders its
# children's replies by it.
LEVEL1_INDEX = "level1_index"


def node_order(metrics: Mapping[str, Scalar]) -> tuple[int, str]:
    """A level-1 node's reply sorted by its index and path, not by arrival order."""
    return int(metrics.get(LEVEL1_INDEX, 0)), str(metrics.get("node", ""))


def usable_needed(min_fit_fraction: float, asked: int) -> int:
    """The usable updates a round needs: ceil(min_fit_fraction x asked), at least 1 (a product
    that float arithmetic puts just above an integer is that integer)."""
    return max(1, math.ceil(min_fit_fraction * asked - 1e-9))


def accept_results(
    results: Sequence[tuple[ClientProxy, FitRes]], reference: Sequence, order_key: str, node: str
) -> tuple[list[Update], int]:
    """Updates that can be aggregated, ordered by ``metrics[order_key]`` (or the child node's
    path) so that float sums do not depend on arrival order, and the number rejected (logged
    with the reason, under ``node``'s name). Empty payloads (a subtree with nothing to report) are skipped, not rejected."""
    accepted, rejected = [], 0
    unpacked: list[tuple[ClientProxy, FitRes, Payload | str]] = []
    for proxy, res in results:
        try:
            unpacked.append((proxy, res, unpack(decode(res.parameters), res.metrics)))
        except (ValueError, KeyError) as exc:
            unpacked.append((proxy, res, f"malformed payload: {exc}"))
    # NaN/Inf checked for all updates at once; only if one has some, update by update to name it.
    finite = all_finite([p.main for _, _, p in unpacked if isinstance(p, Payload) and "model" in p.parts])
    for proxy, res, payload in unpacked:
        if isinstance(payload, str):
            problem = payload
        else:
            if payload.kind == "empty":
                continue
            problem = update_problem(payload.main, reference, finite) if "model" in payload.parts else "no model part"
        if problem is None and res.num_examples <= 0:
            problem = f"num_examples is {res.num_examples}"
        if problem is not None:
            rejected += 1
            log.warning("%s: rejected the update of %s: %s", node, proxy.cid, problem)
            continue
        accepted.append(Update(payload.main, res.num_examples, res.metrics, payload.parts))
    accepted.sort(key=lambda u: u.metrics.get(order_key, u.metrics.get("node", 0)))
    return accepted, rejected


class NodeStrategy(Strategy):
    """An inner node's rounds over its children for one call: the rule's model goes down (with
    the rule's fit config), the accepted replies come back to the rule."""

    def __init__(self, rule: ServerRule, min_fit_fraction: float = 1.0, order_key: str = "device_id") -> None:
        self.rule = rule
        self.min_fit_fraction = min_fit_fraction
        self.order_key = order_key  # what orders the children's replies (a device's id; a node's level-1 index)
        # What its devices' FitIns carry; the root's children are always nodes, and its rule may have
        # none to give (FeMAM's root keeps no level of its own).
        self.fit_config = rule.fit_config() if rule.ctx.path else {}
        # Differential privacy where the run's privacy section puts it at this node's level (hfl.node.privacy).
        self.privacy = NodePrivacy.of(rule.ctx)
        if self.privacy is not None:
            self.fit_config = {**self.fit_config, **self.privacy.device_config()}
        self.current = rule.start()

    @property
    def _name(self) -> str:
        """How its log lines name the node: ``node 0.1``, ``root``."""
        return f"node {self.rule.ctx.path}" if self.rule.ctx.path else "root"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        # Kept as arrays, encoded only if sent out of the process (hfl.rules.payload.LocalParameters).
        return LocalParameters(self.current)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.current = self.rule.prepare(server_round, decode(parameters))
        message = self.rule.fit_message(server_round, self.current)
        arrays, meta = message
        shared = LocalParameters(arrays)
        config = {**self.fit_config, **meta, NODE_ROUND: server_round}
        out = []
        for proxy in sorted(client_manager.all().values(), key=lambda p: path_order(p.cid)):  # tree order
            own = self.rule.child_message(server_round, message, proxy.cid)
            if own is None:
                out.append((proxy, FitIns(shared, config)))
            else:
                out.append((proxy, FitIns(LocalParameters(own[0]), {**self.fit_config, **own[1],
                                                                     NODE_ROUND: server_round})))
        return out

    def merge_reference(self) -> NDArrays:
        """What a stale reply is merged against (hfl.clock): the node's model as it sent it this round,
        after ``prepare`` (e.g. B-HFL's proxy training), as at the root."""
        return self.current

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        accepted, rejected = accept_results(results, self.current, self.order_key, self._name)
        keys = [u.metrics[self.order_key] for u in accepted if self.order_key in u.metrics]
        if len(set(keys)) != len(keys):
            twice = sorted({k for k in keys if keys.count(k) > 1})
            raise RuntimeError(f"{self._name} round {server_round}: two replies from the same child ({self.order_key} "
                               f"{twice}): two processes serve one child (a deployment: check partition-id)")
        asked = len(results) + len(failures)
        needed = usable_needed(self.min_fit_fraction, asked)
        stats: dict[str, Scalar] = {"rejected": rejected, "failures": len(failures), "aggregated": len(accepted)}
        if len(accepted) < needed:
            log.error("%s round %d: %d usable updates of %d asked, %d needed (min_fit_fraction %g)",
                      self._name, server_round, len(accepted), asked, needed, self.min_fit_fraction)
            return None, {**stats, "needed": needed}
        round_path = f"{self.rule.ctx.round_path}.{server_round}" if self.rule.ctx.round_path else str(server_round)
        if self.privacy is not None:  # the rule sees the clipped, noised updates only (central DP)
            accepted, private = self.privacy.privatize(accepted, self.current, round_path)
            stats.update(private)
        self.current = self.rule.aggregate(self.current, Replies(server_round, round_path, accepted))
        # The next configure_fit and the node's batched devices read the arrays back without decoding.
        return LocalParameters(self.current), stats

    def privacy_state(self) -> dict:
        """What the node's privacy keeps between its calls (adaptive clipping's C), stored with its state."""
        return self.privacy.state() if self.privacy is not None else {}

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: ANN001
        return []  # the node evaluates its children itself (hfl.node.client)

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: ANN001
        return None, {}

    def evaluate(self, server_round, parameters):  # noqa: ANN001
        return None
