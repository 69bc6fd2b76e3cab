"""FeMAM device: an additive model over levels, the newest one trained, the older ones frozen.

The device keeps the final model of every finished level it was handed (``freeze`` in the first
round of the next level) and whether the root let it keep that level. ``fit`` reports the
validation loss of the additive model with the level model it received, then trains only that
level for ``local_epochs`` epochs (minibatch SGD, no momentum, as the authors' code) on
CE(mean of the level outputs) + prox * ||theta - theta_received||^2. Its PM is the mean of its
kept levels' outputs and its current group's model (sent with the evaluation, ``ctx_*`` parts).

BatchNorm (ResNet-9): as in the authors' code, the frozen levels run in eval mode (their running
statistics, never updated); the trained level runs in train mode, its running statistics updated
by each forward pass and sent with its parameters (hfl.device.training.LocalTrainer's tensor list); the
prox term and the SGD step apply to its parameters only. Validation and the PM use eval mode.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.device.state import DeviceRuntime
from hfl.rules.payload import unpack
from hfl.device.training import Params, to_ndarrays, to_tensors
from strategies.femam import parse_info
from strategies.femam_rules import CLUSTER, GLOBAL, PERSONAL, TEAM, additive_loss, additive_output, in_prediction


class FemamClient(DeviceClient):
    # ------------------------------------------------------------ kept state
    def kept(self, num_levels: int) -> np.ndarray:
        """Per level: -1 not finished, 1 kept, 0 pruned."""
        return np.asarray(self.device.extra.get("kept", -np.ones(num_levels, dtype=np.int64)), dtype=np.int64).copy()

    def frozen(self, level: int) -> Params:
        names = sorted((k for k in self.device.extra if k.startswith(f"frozen{level}_")), key=lambda k: int(k.split("_")[1]))
        return [torch.from_numpy(np.asarray(self.device.extra[k], dtype=np.float32).copy()) for k in names]

    def freeze(self, level: int, model: NDArrays, keep: int, num_levels: int) -> None:
        kept = self.kept(num_levels)
        kept[level] = keep
        self.device.extra["kept"] = kept
        for i, a in enumerate(model):
            self.device.extra[f"frozen{level}_{i}"] = np.asarray(a, dtype=np.float32)

    def frozen_models(self, below: int, prune: str) -> list[Params]:
        """The finished levels (< ``below``) its predictor sums."""
        kept = self.kept(below)[:below]
        return [self.frozen(level) for level in in_prediction(kept, prune)]

    # ------------------------------------------------------------ the additive model
    def outputs(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """A level's outputs with BatchNorm in eval mode (frozen levels, validation, the PM)."""
        return self.device.trainer.outputs(params, x)

    @torch.no_grad()
    def frozen_sum(self, models: list[Params], x: torch.Tensor) -> torch.Tensor | None:
        if not models:
            return None
        return torch.stack([self.outputs(m, x) for m in models]).sum(0)

    @torch.no_grad()
    def additive_scores(self, models: list[Params], x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """Summed cross-entropy of the mean output, number correct, samples."""
        if len(y) == 0:
            return 0.0, 0, 0
        mean = additive_output(self.frozen_sum(models[:-1], x), self.outputs(models[-1], x), len(models))
        loss = float(torch.nn.functional.cross_entropy(mean, y, reduction="sum"))
        return loss, int((mean.argmax(1) == y).sum()), len(y)

    # ------------------------------------------------------------ Flower
    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        dev = self.device
        parts = unpack(parameters, config).parts
        level, num_levels, prune = int(config["femam_level"]) - 1, int(config["num_levels"]), str(config["prune"])
        if int(config["femam_first"]) and level > 0:
            self.freeze(level - 1, parts["freeze"], int(config["femam_keep"]), num_levels)
        if parts["model"]:
            start = to_tensors(parts["model"])
        elif dev.personal is not None:
            start = [p.clone() for p in dev.personal]
        else:
            raise RuntimeError(f"device {dev.device_id}: personal level without a model of its own")
        frozen = self.frozen_models(level, prune)
        val_loss, _, val_n = self.additive_scores([*frozen, start], dev.x_val, dev.y_val)
        params, loss = self.train(start, frozen, config)
        if config["femam_kind"] == PERSONAL:
            dev.personal = params
        return to_ndarrays(params), len(dev.y_train), {"device_id": dev.device_id, "train_loss": loss,
                                                       "val_loss_sum": val_loss, "val_n": val_n}

    def train(self, start: Params, frozen: list[Params], config: dict[str, Scalar]) -> tuple[Params, float]:
        """``local_epochs`` epochs (else ``local_steps`` steps) of SGD on the newest level only."""
        dev = self.device
        epochs = int(config.get("local_epochs", 0))
        steps = epochs * math.ceil(len(dev.y_train) / dev.sampler.batch_size) if epochs else int(config["local_steps"])
        lr, prox, count = float(config["alpha"]), float(config["prox"]), len(frozen) + 1
        fixed = self.frozen_sum(frozen, dev.x_train)  # frozen levels do not move: their outputs once per round
        trainer = dev.trainer
        is_buffer = trainer.buffer_mask
        anchor = [p.detach() for p, b in zip(start, is_buffer, strict=True) if not b]
        params = [p.clone() for p in start]
        total = 0.0
        for _ in range(steps):
            idx = dev.sampler.next()
            leaves = [p if b else p.detach().requires_grad_(True) for p, b in zip(params, is_buffer, strict=True)]
            trainable = [p for p, b in zip(leaves, is_buffer, strict=True) if not b]
            x, y = dev.x_train.index_select(0, idx), dev.y_train.index_select(0, idx)
            out, buffers = trainer.train_outputs(leaves, x)  # BatchNorm on batch statistics
            loss = additive_loss(None if fixed is None else fixed.index_select(0, idx), out,
                                 count, y, trainable, anchor, prox)
            grads = iter(torch.autograd.grad(loss, trainable))
            stepped = [p if b else p.detach() - lr * next(grads) for p, b in zip(leaves, is_buffer, strict=True)]
            params = trainer.with_buffers(stepped, buffers)  # the running statistics BatchNorm computed
            total += float(loss.detach())
        return params, total / max(steps, 1)

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        if config.get("model") != "personal":
            return super().evaluate(parameters, config)
        dev = self.device
        loss_sum, correct, n = self.additive_scores(self.personal_levels(parameters, config), dev.x_test, dev.y_test)
        return loss_sum / n, n, {"device_id": dev.device_id, "correct": correct}

    def personal_levels(self, parameters: NDArrays, config: dict[str, Scalar]) -> list[Params]:
        """The models its PM sums: kept finished levels, then the current level's model for it
        (left out where the root just pruned it, under the paper's rule)."""
        dev = self.device
        ctx = unpack(parameters, config).parts
        info = parse_info(ctx, "ctx_info")
        level, kind = info["level"] - 1, info["kind"]
        models = self.frozen_models(level, info["prune"])
        if kind in (GLOBAL, CLUSTER):
            current = to_tensors(ctx[f"ctx_g{int(ctx['ctx_assign'][0][dev.device_id])}"])
        elif kind == TEAM:
            current = to_tensors(ctx["ctx_node"])
        elif dev.personal is not None:
            current = dev.personal
        else:
            raise RuntimeError(f"device {dev.device_id} has no personal-level model yet")
        # ctx_info's "first" flag marks evaluation right after the root decided this level's pruning.
        pruned = info["first"] and info["prune"] == "paper" and int(ctx["ctx_keep"][0][dev.device_id]) == 0
        if pruned and models:
            return models
        return [*models, current]


def make_client(device: DeviceRuntime) -> FemamClient:
    return FemamClient(device)
