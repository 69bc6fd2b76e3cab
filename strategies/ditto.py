"""Ditto servers: FedAvg of the devices' global-model updates; the devices also get lam."""

from strategies.fedavg import FedAvgServer


class DittoServer(FedAvgServer):
    keys = ("lam",)


SERVER = DittoServer
