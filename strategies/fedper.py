"""FedPer servers: FedAvg's weighted means (of the bodies; heads come back unchanged)."""

from strategies.fedavg import FedAvgServer


class FedPerServer(FedAvgServer):
    keys = ("head_layers",)


SERVER = FedPerServer
