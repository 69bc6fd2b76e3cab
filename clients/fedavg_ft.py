"""FedAvg+ device (FeMAM's baseline): trains as FedAvg's device; its PM is the global model it
is sent, fine-tuned for ``finetune_epochs`` passes of minibatch SGD (``finetune_lr``) over its
own training split.

Fine-tuning happens at evaluation time only (config ``model=personal``, whose parameters are
the global model: ``pm_base: gm``, hfl/node/client.py). It draws its minibatches from a sampler
of its own, seeded by (run seed, device, global round), so an evaluation is reproducible and
leaves the device's training sampler where it was; the fine-tuned model is neither kept nor
sent. Evaluation messages carry only the model, so the device takes the settings and the round
from its last training round's config (kept in ``device.extra``, saved with the device).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.common import NDArrays, Scalar

from clients.fedavg import FedAvgClient
from hfl.rules.steps import sgd_step
from hfl.device.plan import FitPlan
from hfl.device.state import DeviceRuntime
from hfl.seed import derive_seed
from hfl.device.training import BatchSampler, LocalTrainer, Params, run_local_steps, to_tensors

# device.extra keys: what the last training round said about fine-tuning
EPOCHS, LR, ROUND = "finetune_epochs", "finetune_lr", "finetune_round"


def finetune(trainer: LocalTrainer, start: Params, x: torch.Tensor, y: torch.Tensor, *, batch_size: int,
             epochs: int, lr: float, seed: int) -> Params:
    """``epochs`` shuffled passes of minibatch SGD (lr ``lr``) over (x, y) from ``start``, the
    batch order drawn from ``seed`` alone (an epoch's last batch may be short)."""
    steps = epochs * math.ceil(len(y) / batch_size)
    params, _ = run_local_steps(trainer, start, x, y, BatchSampler(len(y), batch_size, seed), steps,
                                lambda p, g: sgd_step(p, g, lr))
    return params


def global_round(config: dict[str, Scalar]) -> int:
    """The global round of a training message (``round_path`` "g.t...", hfl/node/inprocess.py)."""
    path = str(config.get("round_path", config.get("global_round", 0)))
    head = path.split(".")[0]
    return int(head) if head.isdigit() else 0


class FedAvgFtClient(FedAvgClient):
    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan:
        plan = super().fit_plan(parameters, config)
        train_finish = plan.finish

        def finish(models: list[Params], losses: list[float]) -> tuple[NDArrays, int, dict[str, Scalar]]:
            extra = self.device.extra
            extra[EPOCHS] = np.array(int(config[EPOCHS]))
            extra[LR] = np.array(float(config[LR]))
            extra[ROUND] = np.array(global_round(config))
            return train_finish(models, losses)

        return FitPlan(plan.phases, finish)

    def finetuned(self, received: Params) -> Params:
        """The PM: the received global model fine-tuned on the device's training split."""
        dev = self.device
        if EPOCHS not in dev.extra:
            raise RuntimeError(f"device {dev.device_id} has not trained yet, so it holds no fine-tuning settings "
                               "(FedAvg+ needs every device in every round)")
        seed = derive_seed(dev.seed, "finetune", dev.device_id, int(dev.extra[ROUND]))
        return finetune(dev.trainer, received, dev.x_train, dev.y_train, batch_size=dev.sampler.batch_size,
                        epochs=int(dev.extra[EPOCHS]), lr=float(dev.extra[LR]), seed=seed)

    def model_to_test(self, parameters: NDArrays, config: dict[str, Scalar]) -> Params:
        if config.get("model") != "personal":
            return to_tensors(parameters)  # GM, or a server's model: as sent
        if not len(parameters):
            raise RuntimeError(f"device {self.device.device_id}: FedAvg+ fine-tunes the global model it is sent with "
                               "model=personal, and this evaluation sent none (the deployment runtime's evaluation "
                               "does not yet); run it in simulation or in process")
        return self.finetuned(to_tensors(parameters))


def make_client(device: DeviceRuntime) -> FedAvgFtClient:
    return FedAvgFtClient(device)
