"""FedRep servers: FedAvg's weighted means (of the bodies; heads come back unchanged)."""

from strategies.fedavg import FedAvgServer


class FedRepServer(FedAvgServer):
    personalized = True  # PM = [shared body, own head]
    global_model = False  # PM only
    keys = ("head_layers", "head_steps")


SERVER = FedRepServer
