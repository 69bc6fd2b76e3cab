"""Ditto servers: FedAvg of the devices' global-model updates; the devices also get lam."""

from strategies.fedavg import FedAvgServer


class DittoServer(FedAvgServer):
    personalized = True  # PM = v
    keys = ("lam",)


SERVER = DittoServer
