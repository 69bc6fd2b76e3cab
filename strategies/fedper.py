"""FedPer servers: FedAvg's weighted means (of the bodies; heads come back unchanged)."""

from strategies.fedavg import FedAvgServer


class FedPerServer(FedAvgServer):
    personalized = True  # PM = [shared body, own head]
    global_model = False  # the servers hold no usable head
    keys = ("head_layers",)


SERVER = FedPerServer
