"""A child that is dead for one round: ``DroppedProxy`` answers ``fit`` with ``SimulatedFault``
and passes everything else to the real child. The simulated faults (hfl.node.faults) drop
children through it, and the clock (hfl.clock.timer) the devices that went offline.
"""

from __future__ import annotations

from flwr.common import (
    DisconnectRes,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetParametersIns,
    GetParametersRes,
    GetPropertiesIns,
    GetPropertiesRes,
    ReconnectIns,
)
from flwr.server.client_proxy import ClientProxy


class SimulatedFault(ConnectionError):
    """A child that ``runtime.dropout`` / ``runtime.dropout_nodes`` failed for one round."""


class DroppedProxy(ClientProxy):
    """A child that is dead for one round: ``fit`` raises ``SimulatedFault``; everything else
    (evaluation, properties) goes to the real child."""

    def __init__(self, proxy: ClientProxy, reason: str) -> None:
        super().__init__(proxy.cid)
        self.proxy = proxy
        self.reason = reason

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        raise SimulatedFault(self.reason)

    def get_properties(self, ins: GetPropertiesIns, timeout: float | None, group_id: int | None) -> GetPropertiesRes:
        return self.proxy.get_properties(ins, timeout, group_id)

    def get_parameters(self, ins: GetParametersIns, timeout: float | None, group_id: int | None) -> GetParametersRes:
        return self.proxy.get_parameters(ins, timeout, group_id)

    def evaluate(self, ins: EvaluateIns, timeout: float | None, group_id: int | None) -> EvaluateRes:
        return self.proxy.evaluate(ins, timeout, group_id)

    def reconnect(self, ins: ReconnectIns, timeout: float | None, group_id: int | None) -> DisconnectRes:
        return self.proxy.reconnect(ins, timeout, group_id)
