"""Per-FedAvg servers: FedAvg's weighted means of the meta-models; the devices also get
beta, the variant (fo/hf) and delta."""

from strategies.fedavg import FedAvgServer


class PerFedAvgServer(FedAvgServer):
    personalized = True  # PM = the global model after one alpha-step
    any_depth = False  # three tiers only
    keys = ("beta", "variant", "delta")

    @classmethod
    def device_evaluation_config(cls, alg, depth):  # noqa: ANN001, ANN206 - ServerRule's signature
        # A device never trained yet (sampled out, dropped) adapts the model it would start from with alpha.
        return {"alpha": alg["alpha"]}


SERVER = PerFedAvgServer
