"""FedProx servers: FedAvg's weighted means; the devices also get mu."""

from strategies.fedavg import FedAvgServer


class FedProxServer(FedAvgServer):
    keys = ("mu",)


SERVER = FedProxServer
