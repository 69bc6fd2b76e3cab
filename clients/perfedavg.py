"""Per-FedAvg device (Fallah et al., NeurIPS 2020), first-order (FO) and Hessian-free (HF).

One local step on minibatches D, D', D'' (drawn in that order):
    w_tmp = w - alpha * grad f(w; D)
    FO:  w <- w - beta * grad f(w_tmp; D')
    HF:  w <- w - beta * (I - alpha * H f(w; D'')) grad f(w_tmp; D'),
         H v approximated by (grad f(w + delta v; D'') - grad f(w - delta v; D'')) / (2 delta).
PM: the global model after one step of size alpha on the device's training set, computed
when PM is tested (the papers evaluate Per-FedAvg so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.rules.steps import sgd_step
from hfl.accel.batched import batch_width, draw_batches, minibatch, stack
from hfl.device.state import DeviceRuntime
from hfl.errors import ConfigError
from hfl.rules.personal import check_keys, fit_reply
from hfl.device.training import Params, to_tensors

T = TypeVar("T")
VARIANTS = ("fo", "hf")


def check_config(alg: Mapping[str, Any]) -> None:
    if alg.get("variant") not in VARIANTS:
        raise ConfigError("algorithm.variant", f"must be one of {', '.join(VARIANTS)}, got {alg.get('variant')!r}")
    check_keys(alg, beta={"minimum": 0, "open_min": True}, delta={"minimum": 0, "open_min": True})


def hessian_vector_product(grad_plus: Sequence[T], grad_minus: Sequence[T], delta: float) -> list[T]:
    """Central difference (grad f(w + delta v) - grad f(w - delta v)) / (2 delta) ~ H v."""
    return [(p - m) / (2.0 * delta) for p, m in zip(grad_plus, grad_minus, strict=True)]


def hf_direction(grad_tmp: Sequence[T], hvp: Sequence[T], alpha: float) -> list[T]:
    """(I - alpha H) grad f(w_tmp) = grad f(w_tmp) - alpha * H grad f(w_tmp)."""
    return [g - alpha * h for g, h in zip(grad_tmp, hvp, strict=True)]


@dataclass
class MetaPlan:
    """One device's Per-FedAvg fit, for hfl.accel.batched to step a node's devices together
    (``run_together``); ``PerFedAvgClient.fit`` is the same work one device at a time."""

    device: DeviceRuntime
    start: Params
    steps: int
    alpha: float
    beta: float
    variant: str
    delta: float

    def key(self) -> tuple[int, float, float, str, float]:
        return self.steps, self.alpha, self.beta, self.variant, self.delta

    @classmethod
    def run_together(cls, plans: Sequence[MetaPlan], data: Any,
                     loss_and_grad: Callable) -> list[tuple[NDArrays, int, dict[str, Scalar]]]:
        """Plans of equal ``key`` (hfl.accel.batched.GroupPlan), stepped together."""
        return _run_group(plans, data, loss_and_grad)


def _run_group(plans: Sequence[MetaPlan], data: Any, loss_and_grad: Callable) -> list[tuple[NDArrays, int, dict[str, Scalar]]]:
    """Meta-steps of devices with the same settings, stacked; each takes 2 (FO) or 3 (HF)
    consecutive minibatches of its sampler per step, as ``PerFedAvgClient.meta_step`` does."""
    first, devices = plans[0], [p.device for p in plans]
    per_step = 3 if first.variant == "hf" else 2
    index, weight = draw_batches(devices, [data.offset[d.device_id] for d in devices], per_step * first.steps,
                                 batch_width(devices))
    index, weight = index.to(data.device), weight.to(data.device)

    def grad(params: Params, b: int) -> tuple[torch.Tensor, Params]:
        return loss_and_grad(params, *minibatch(data, index[b]), weight[b])

    w = stack([p.start for p in plans], data.device)
    total = torch.zeros(len(plans), device=data.device)
    for s in range(first.steps):
        loss, g = grad(w, per_step * s)
        _, g_tmp = grad(sgd_step(w, g, first.alpha), per_step * s + 1)
        if first.variant == "hf":
            _, g_plus = grad(sgd_step(w, g_tmp, -first.delta), per_step * s + 2)
            _, g_minus = grad(sgd_step(w, g_tmp, first.delta), per_step * s + 2)
            g_tmp = hf_direction(g_tmp, hessian_vector_product(g_plus, g_minus, first.delta), first.alpha)
        w = sgd_step(w, g_tmp, first.beta)
        total += loss
    losses = (total / max(first.steps, 1)).cpu().tolist()
    replies = []
    for plan, w_d, loss_d in zip(plans, zip(*(t.cpu().unbind(0) for t in w), strict=True), losses, strict=True):
        plan.device.personal = [*plan.start, torch.tensor(plan.alpha)]
        replies.append(fit_reply(plan.device, list(w_d), loss_d))
    return replies


class PerFedAvgClient(DeviceClient):
    """``dev.personal`` holds [the latest global model the device saw..., alpha]: the model sent
    for training, replaced by the one sent for GM evaluation (which the team runs before PM), so
    PM adapts the current global model; alpha rides along because evaluation messages carry
    no hyper-parameters and a fresh node must still know the adaptation step."""

    batched = True  # through its own group step (MetaPlan)
    bufferless = "takes its own meta-gradient steps"

    def _grad(self, params: Params, idx: torch.Tensor) -> tuple[torch.Tensor, Params]:
        dev = self.device
        return dev.trainer.loss_and_grad(params, dev.x_train.index_select(0, idx), dev.y_train.index_select(0, idx))

    def meta_step(self, w: Params, alpha: float, beta: float, variant: str, delta: float) -> tuple[Params, float]:
        sampler = self.device.sampler
        loss, g = self._grad(w, sampler.next())
        _, g_tmp = self._grad(sgd_step(w, g, alpha), sampler.next())
        if variant == "hf":
            idx = sampler.next()
            _, g_plus = self._grad(sgd_step(w, g_tmp, -delta), idx)
            _, g_minus = self._grad(sgd_step(w, g_tmp, delta), idx)
            g_tmp = hf_direction(g_tmp, hessian_vector_product(g_plus, g_minus, delta), alpha)
        return sgd_step(w, g_tmp, beta), float(loss)

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> MetaPlan:
        return MetaPlan(self.device, to_tensors(parameters), int(config["local_steps"]), float(config["alpha"]),
                        float(config["beta"]), str(config["variant"]), float(config["delta"]))

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        dev = self.device
        w = to_tensors(parameters)
        dev.personal = [*w, torch.tensor(float(config["alpha"]))]
        steps, losses = int(config["local_steps"]), []
        for _ in range(steps):
            w, loss = self.meta_step(w, float(config["alpha"]), float(config["beta"]), str(config["variant"]),
                                     float(config["delta"]))
            losses.append(loss)
        return fit_reply(dev, w, sum(losses) / max(steps, 1))

    def model_to_test(self, parameters: NDArrays, config: dict[str, Scalar]) -> Params:
        dev = self.device
        if config.get("model") != "personal":
            params = to_tensors(parameters)
            if config.get("model") == "global" and dev.personal is not None:
                dev.personal = [*params, dev.personal[-1]]
            return params
        if dev.personal is None:
            if not (config.get("fallback") and len(parameters) and "alpha" in config):
                raise RuntimeError(f"device {dev.device_id} has no global model to adapt yet")
            # never trained yet (partial participation, faults): the model its first call would start from
            w, alpha = to_tensors(parameters), float(config["alpha"])
            _, grad = dev.trainer.loss_and_grad(w, dev.x_train, dev.y_train)
            return sgd_step(w, grad, alpha)
        *w, alpha = dev.personal
        _, grad = dev.trainer.loss_and_grad(w, dev.x_train, dev.y_train)
        return sgd_step(w, grad, float(alpha))


def make_client(device: DeviceRuntime) -> PerFedAvgClient:
    return PerFedAvgClient(device)
