"""The peer workload in pfl-research (Apple's ``pfl``): ``FederatedAveraging`` on a
``SimulatedBackend``, the model wrapped in pfl's ``PyTorchModel`` (local optimiser SGD, central
optimiser SGD at learning rate 1, so the central step is the averaged update: FedAvg), updates
weighted by the users' data points (``WeightByDatapoints``), a ``FederatedDataset`` of the
exported devices, and pfl's ``CentralEvaluationCallback`` on the union of their test splits
after the last round.

Runs in its own virtual environment (pfl[pytorch], torch), created by benchmarks/peers/run.py:

    python pfl_peer.py DATA.npz --rounds 30                                      # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 pfl_peer.py DATA.npz --rounds 30

The second is pfl's own multi-worker simulation on ``torchrun`` (gloo on a CPU): each worker
trains its share of every cohort and the updates are summed across workers. Every worker steps
on one torch thread (hfl's team actors and the Flower peer's actors do too; on a shared 2-core
machine two OpenMP threads per process slowed pfl's rounds tenfold). Seconds per round are taken
between pfl's ``after_central_iteration`` callbacks (rank 0's).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_common as common  # noqa: E402 - benchmarks/peers/ is no package

from pfl.aggregate.simulate import SimulatedBackend  # noqa: E402
from pfl.aggregate.weighting import WeightByDatapoints  # noqa: E402
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams  # noqa: E402
from pfl.callback.base import TrainingProcessCallback  # noqa: E402
from pfl.callback.central_evaluation import CentralEvaluationCallback  # noqa: E402
from pfl.data.federated_dataset import FederatedDataset  # noqa: E402
from pfl.data.pytorch import PyTorchTensorDataset  # noqa: E402
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams  # noqa: E402
from pfl.internal.ops.pytorch_ops import get_default_device  # noqa: E402
from pfl.metrics import Metrics, Weighted  # noqa: E402
from pfl.model.pytorch import PyTorchModel  # noqa: E402

ACCURACY = "Central val | accuracy"  # CentralEvaluationCallback's default name for our "accuracy"


class PflModule(torch.nn.Module):
    """The workload's model with the two methods pfl's PyTorchModel calls: ``loss`` to train,
    ``metrics`` to evaluate."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.train()
        return torch.nn.functional.nll_loss(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> dict[str, Weighted]:  # noqa: A002
        self.eval()
        out = self(x)
        return {"accuracy": Weighted(float((out.argmax(1) == y).sum()), len(y)),
                "loss": Weighted(float(torch.nn.functional.nll_loss(out, y, reduction="sum")), len(y))}


class DeviceDataset(PyTorchTensorDataset):
    """A device's training data. pfl's own datasets slice their data in order and stop after one
    epoch (``local_num_steps`` stops *before* its count when the epoch ends); the workload asks
    for 20 steps at batch 10 whatever the device's size, shuffled each epoch, as hfl and the
    Flower peer step. So training iterates ``steps`` shuffled batches across epochs; a request
    for batches as large as the data (pfl's evaluation of a user) gets the data once."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, user_id: int, steps: int, generator: torch.Generator) -> None:
        super().__init__((x, y), user_id=str(user_id))
        self._steps, self._generator = steps, generator

    def iter(self, batch_size: int | None) -> Iterator:  # noqa: A003 - pfl's name
        x, y = self.raw_data
        if batch_size is None or batch_size >= len(y):
            yield x, y
            return
        for idx in common.epoch_batches(len(y), batch_size, self._steps, self._generator):
            yield x[idx], y[idx]


class CohortSampler:
    """pfl's user sampler interface (``callable() -> user_id``): users drawn without replacement
    from a seeded shuffle of all of them, reshuffled once all are drawn. With 1,000 devices and
    cohorts of 100 every cohort holds 100 distinct devices, as Flower's and hfl's draws do
    (pfl's ``random`` sampler draws with replacement, ``minimize_reuse`` in a fixed order)."""

    def __init__(self, users: int, seed: int) -> None:
        self._users, self._rng, self._order, self._at = users, np.random.default_rng(seed), [], 0

    def __call__(self) -> int:
        if self._at == len(self._order):
            self._order, self._at = self._rng.permutation(self._users).tolist(), 0
        self._at += 1
        return self._order[self._at - 1]


class RoundClock(TrainingProcessCallback):
    """Times every central iteration and keeps the central evaluation's accuracy (it must come
    after CentralEvaluationCallback in the list: callbacks see the metrics of those before)."""

    def __init__(self) -> None:
        self.clock: list[float] = []
        self.accuracy: float | None = None

    def on_train_begin(self, *, model: PyTorchModel) -> Metrics:
        self.clock.append(time.perf_counter())
        return Metrics()

    def after_central_iteration(self, aggregate_metrics: Metrics, model: PyTorchModel, *,
                                central_iteration: int) -> tuple[bool, Metrics]:
        self.clock.append(time.perf_counter())
        for name, value in aggregate_metrics:
            if str(name) == ACCURACY:
                self.accuracy = float(value.overall_value)
        return False, Metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--pfl-datasets", action="store_true",
                        help="pfl's own user datasets instead (in order, unshuffled, and local_num_steps stops at "
                        "the end of one epoch: fewer steps on devices under 200 samples; not the workload)")
    parser.add_argument("--sample-seed", type=int, help="the cohorts' seed (default: the workload's); the spread "
                        "of final accuracies over seeds is the noise of comparing frameworks that draw apart")
    args = parser.parse_args()
    if args.rounds < 3:
        raise SystemExit("--rounds: at least 3 (one warm-up, one timed, the evaluated last)")
    start = time.perf_counter()
    torch.set_num_threads(1)
    fed = common.Federation(args.data)
    meta = fed.meta
    seed, steps = int(meta["seed"]), int(meta["local_steps"])
    torch.manual_seed(seed)
    module = PflModule(fed.build_model())
    device = get_default_device()  # pfl's choice: CUDA when torch sees a GPU (PFL_PYTORCH_DEVICE overrides)
    fed.to(device)  # every device's data on it once, as hfl keeps them: a batch is then a slice, not a copy
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))

    rounds_made: dict[int, int] = {}  # user -> times drawn: each draw shuffles anew

    def make_dataset(user: int) -> PyTorchTensorDataset:
        rounds_made[user] = rounds_made.get(user, 0) + 1
        x, y = fed.device(user)
        if args.pfl_datasets:
            return PyTorchTensorDataset((x, y), user_id=str(user))
        return DeviceDataset(x, y, user, steps, common.device_generator(seed, user, rounds_made[user]))

    training = FederatedDataset(make_dataset, CohortSampler(fed.devices, seed if args.sample_seed is None
                                                            else args.sample_seed))
    x_test, y_test = fed.union("test")
    clock = RoundClock()
    callbacks = [CentralEvaluationCallback(PyTorchTensorDataset((x_test, y_test)),
                                           model_eval_params=NNEvalHyperParams(local_batch_size=None),
                                           frequency=args.rounds - 1),  # iterations count from 0: the last
                 clock]
    algorithm = FederatedAveraging()
    algorithm.run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds,
                                           evaluation_frequency=args.rounds,  # per-user evaluation at iteration 0 only
                                           train_cohort_size=int(meta["per_round"]), val_cohort_size=0),
        backend=SimulatedBackend(training_data=training, val_data=None, postprocessors=[WeightByDatapoints()]),
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=float(meta["learning_rate"]), local_num_epochs=None,
                                              local_num_steps=steps, local_batch_size=int(meta["batch_size"])),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=callbacks,
    )
    total = time.perf_counter() - start
    if torch.distributed.is_initialized():
        # Leave together and close gloo's group: a worker that exits with it open may abort in
        # the group's destructor (seen once: SIGABRT after its last round), and torchrun then
        # fails the whole run.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return  # torchrun: rank 0 reports (every rank holds the same model and metrics)
    if clock.accuracy is None or len(clock.clock) != args.rounds + 1:
        raise SystemExit(f"pfl: {len(clock.clock) - 1} of {args.rounds} rounds, central accuracy "
                         f"{clock.accuracy}: the run failed")
    common.report("pfl-research", list(np.diff(clock.clock)), clock.accuracy, total_seconds=total,
                  startup_seconds=clock.clock[0] - start, workers=int(os.environ.get("WORLD_SIZE", "1")),
                  device=str(device))


if __name__ == "__main__":
    main()
