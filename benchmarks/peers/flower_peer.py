"""The peer workload in Flower's own Simulation Runtime: one virtual SuperNode and one
``NumPyClient`` per device, the legacy ``FedAvg`` strategy in a ``ServerApp`` (fraction_fit =
per_round / devices, weighted by the samples each client reports), central evaluation with
``evaluate_fn`` after the last round, ``flwr.simulation.run_simulation`` on Ray.

Runs in its own virtual environment (flwr[simulation], torch), created by benchmarks/peers/run.py:

    python flower_peer.py DATA.npz --rounds 30

Each Ray actor takes one CPU (``client_resources``; Flower's default of two would leave one actor
on a 2-core machine) and steps on one torch thread, as hfl's team actors do. Seconds per round
are taken between the calls Flower makes to ``evaluate_fn`` (after every round's aggregation).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers_common.py
import peers_common as common  # noqa: E402 - benchmarks/peers/ is no package

from flwr.client import Client, ClientApp, NumPyClient  # noqa: E402
from flwr.common import Context, NDArrays, Scalar, ndarrays_to_parameters  # noqa: E402
from flwr.server import ServerApp, ServerAppComponents, ServerConfig  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

DATA_ENV = "HFL_PEERS_DATA"  # the .npz path, inherited by Ray's workers from the driver's environment
HERE = Path(__file__).resolve().parent


class DeviceClient(NumPyClient):
    """One device: receives the global model, runs local_steps SGD steps at batch_size, returns
    the model and its training-set size (FedAvg's weight)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.fed = common.cached_federation(os.environ[DATA_ENV])  # once per actor process
        self.model = self.fed.build_model()

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        meta = self.fed.meta
        with torch.no_grad():
            for p, value in zip(self.model.parameters(), parameters):
                p.copy_(torch.from_numpy(value))
        x, y = self.fed.device(self.device)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=float(meta["learning_rate"]))
        generator = common.device_generator(int(meta["seed"]), self.device, int(config["server_round"]))
        for idx in common.epoch_batches(len(y), int(meta["batch_size"]), int(meta["local_steps"]), generator):
            optimizer.zero_grad()
            torch.nn.functional.nll_loss(self.model(x[idx]), y[idx]).backward()
            optimizer.step()
        return [p.detach().numpy().copy() for p in self.model.parameters()], len(y), {}


def client_fn(context: Context) -> Client:
    torch.set_num_threads(1)  # one core per actor; more threads only oversubscribe a 2-core machine
    return DeviceClient(int(context.node_config["partition-id"])).to_client()


def make_server_app(rounds: int, clock: list[float], final: dict[str, float]) -> ServerApp:
    test = common.Federation(os.environ[DATA_ENV], ("test",))
    evaluator = test.build_model()
    x_test, y_test = test.union("test")

    def evaluate_fn(server_round: int, parameters: NDArrays,
                    config: dict[str, Scalar]) -> tuple[float, dict[str, Scalar]] | None:
        clock.append(time.perf_counter())  # called at round 0 and after each round's aggregation
        if server_round < rounds:
            return None  # one evaluation, after the last round (the other frameworks' too)
        with torch.no_grad():
            for p, value in zip(evaluator.parameters(), parameters):
                p.copy_(torch.from_numpy(value))
        acc, loss = common.accuracy(evaluator, x_test, y_test)
        final.update(accuracy=acc, loss=loss)
        return loss, {"accuracy": acc}

    def server_fn(context: Context) -> ServerAppComponents:
        devices, per_round = test.devices, int(test.meta["per_round"])
        strategy = FedAvg(
            fraction_fit=per_round / devices,
            fraction_evaluate=0.0,            # no federated evaluation: the central evaluator alone
            min_fit_clients=per_round,
            min_evaluate_clients=0,
            min_available_clients=devices,    # draw from all of them, not from those registered first
            initial_parameters=ndarrays_to_parameters([np.asarray(a) for a in test.init]),
            evaluate_fn=evaluate_fn,
            on_fit_config_fn=lambda rnd: {"server_round": rnd},  # seeds the clients' minibatch order
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    return ServerApp(server_fn=server_fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cpus-per-client", type=float, default=1.0)
    args = parser.parse_args()
    os.environ[DATA_ENV] = str(args.data.resolve())
    # Ray's workers import ``common`` by name (the clients' data cache lives there): they inherit this path.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a Ray FutureWarning
    torch.set_num_threads(1)
    with np.load(args.data) as f:
        devices = int(f["devices"])
    clock: list[float] = []
    final: dict[str, float] = {}
    start = time.perf_counter()
    run_simulation(
        server_app=make_server_app(args.rounds, clock, final),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=devices,
        backend_config={"client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0}},
    )
    total = time.perf_counter() - start
    if len(clock) != args.rounds + 1 or "accuracy" not in final:
        raise SystemExit(f"flower: {len(clock) - 1} of {args.rounds} rounds evaluated; the run failed (see its log)")
    common.report("Flower simulation", list(np.diff(clock)), final["accuracy"], total_seconds=total,
                  startup_seconds=clock[0] - start)


if __name__ == "__main__":
    main()
