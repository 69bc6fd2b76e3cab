"""Per-FedAvg servers: FedAvg's weighted means of the meta-models; the devices also get
beta, the variant (fo/hf) and delta."""

from strategies.fedavg import FedAvgServer


class PerFedAvgServer(FedAvgServer):
    keys = ("beta", "variant", "delta")


SERVER = PerFedAvgServer
