"""pFedBayes device (Zhang et al., ICML 2022, Algorithm 1) over any of hfl's models.

Every weight is a Gaussian N(mu, sigma^2), sigma = softplus(rho); exchanged models are
[mu_1..mu_n, rho_1..rho_n]. The device keeps its personal distribution q (its PM) and a
localized copy v of the global distribution it received. Per local iteration, on one
minibatch:
  ``personal_steps`` times: w = mu_q + sigma_q * eps (reparameterization, eps ~ N(0, s^2)),
      q <- q - personal_lr * grad_q [mean NLL(w) + (zeta / n) KL(q || v)];
  once: v <- v - alpha * grad_v (zeta / n) KL(q || v).
v goes back to be averaged. Models are tested at their means (mu).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.common import NDArrays, Scalar

from hfl.device.client import DeviceClient
from hfl.accel.batched import batch_width, labels_at, pad_batches, per, phase_steps, stack
from hfl.accel.closed_forms import SCALED_STEPS
from hfl.device.state import DeviceRuntime
from hfl.rules.personal import check_keys, fit_reply
from hfl.device.training import Params, to_tensors


def check_config(alg: Mapping[str, Any]) -> None:
    check_keys(alg, personal_lr={"minimum": 0, "open_min": True}, zeta={"minimum": 0},
               personal_steps={"integer": True, "minimum": 1}, noise_scale={"minimum": 0},
               rho_offset={}, beta={"minimum": 0, "open_min": True})


def split(params: Sequence[torch.Tensor]) -> tuple[Params, Params]:
    """[mu..., rho...] -> (mu, rho)."""
    half = len(params) // 2
    return list(params[:half]), list(params[half:])


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.softplus(x)``, log(1 + e^x) (x above 20), within 4 ulps and ~3.5x
    faster on the CPU: PyTorch's kernel calls the scalar ``log1p`` per element (750 us for a
    [10, 10, 784] MNIST MCLR weight here, the largest cost of a pFedBayes step). Here
    ``log1p(y) = y log(u) / (u - 1)``, ``u = 1 + y`` (Goldberg's correction; 0/0, i.e. y, where u
    rounds to 1), vectorized, in place: three temporaries, so that their allocation stays cheap.
    Above 20, ``max(softplus(20), x) = x``. Tested against float64."""
    y = x.clamp(max=20.0).exp_()
    u = y + 1.0
    out = u.log()
    out.div_(u.sub_(1.0)).nan_to_num_(nan=1.0).mul_(y)
    return out.clamp_(min=x)


def sample_weights(mu: Params, rho: Params, eps: Params) -> Params:
    """w = mu + softplus(rho) * eps."""
    return [m + softplus(r) * e for m, r, e in zip(mu, rho, eps, strict=True)]


def gaussian_kl(mu_q: Params, rho_q: Params, mu_p: Params, rho_p: Params) -> float:
    """KL(N(mu_q, sigma_q^2) || N(mu_p, sigma_p^2)) summed over all weights."""
    total = 0.0
    for mq, rq, mp, rp in zip(mu_q, rho_q, mu_p, rho_p, strict=True):
        sq, sp = softplus(rq), softplus(rp)
        total += float((torch.log(sp / sq) + (sq**2 + (mq - mp) ** 2) / (2 * sp**2) - 0.5).sum())
    return total


def kl_grads(mu_q: Params, rho_q: Params, mu_p: Params, rho_p: Params) -> tuple[Params, Params, Params, Params]:
    """d KL(q || p) / d (mu_q, rho_q, mu_p, rho_p), in closed form (d sigma / d rho = sigmoid(rho))."""
    sq, sp = [softplus(r) for r in rho_q], [softplus(r) for r in rho_p]
    g_mq = [(mq - mp) / s**2 for mq, mp, s in zip(mu_q, mu_p, sp, strict=True)]
    g_rq = [(q / s**2 - 1 / q) * torch.sigmoid(r) for q, s, r in zip(sq, sp, rho_q, strict=True)]
    return g_mq, g_rq, *prior_kl_grads(mu_q, mu_p, sq, sp, rho_p)


def prior_kl_grads(mu_q: Params, mu_p: Params, sq: Params, sp: Params, rho_p: Params) -> tuple[Params, Params]:
    """``kl_grads``'s (mu_p, rho_p) side, from the sigmas ``sq``, ``sp`` already taken."""
    diff = [mq - mp for mq, mp in zip(mu_q, mu_p, strict=True)]
    return ([-d / s**2 for d, s in zip(diff, sp, strict=True)],
            [(1 / s - (q**2 + d**2) / s**3) * torch.sigmoid(r) for d, q, s, r in zip(diff, sq, sp, rho_p, strict=True)])


def personal_step(mu: Params, rho: Params, grad_w: Params, eps: Params, kl_mu: Params, kl_rho: Params,
                  lr: float, kl_weight: float) -> tuple[Params, Params]:
    """One step on mean NLL(mu + softplus(rho) eps) + kl_weight * KL: d/dmu = grad_w,
    d/drho = grad_w * eps * sigmoid(rho) for the data term."""
    new_mu = [m - lr * (g + kl_weight * k) for m, g, k in zip(mu, grad_w, kl_mu, strict=True)]
    new_rho = [r - lr * (g * e * torch.sigmoid(r) + kl_weight * k)
               for r, g, e, k in zip(rho, grad_w, eps, kl_rho, strict=True)]
    return new_mu, new_rho


def prior_step(mu: Params, rho: Params, kl_mu: Params, kl_rho: Params, lr: float, kl_weight: float) -> tuple[Params, Params]:
    """v <- v - lr * kl_weight * d KL(q || v) / dv."""
    return ([m - lr * kl_weight * k for m, k in zip(mu, kl_mu, strict=True)],
            [r - lr * kl_weight * k for r, k in zip(rho, kl_rho, strict=True)])


@dataclass
class BayesPlan:
    """One device's pFedBayes fit, for hfl.accel.batched to step a node's devices together
    (``run_together``); ``PFedBayesClient.fit`` is the same work one device at a time."""

    device: DeviceRuntime
    q: Params  # [mu..., rho...] of the personal distribution
    v: Params  # the localized global distribution
    steps: int
    personal_steps: int
    personal_lr: float
    lr: float
    noise_scale: float
    kl_weight: float

    def key(self) -> tuple[int, int, float, float]:
        return self.steps, self.personal_steps, self.personal_lr, self.lr

    @classmethod
    def run_together(cls, plans: Sequence[BayesPlan], data: Any,
                     loss_and_grad: Callable) -> list[tuple[NDArrays, int, dict[str, Scalar]]]:
        """Plans of equal ``key`` (hfl.accel.batched.GroupPlan), stepped together."""
        return _run_group(plans, data, loss_and_grad)


def _draws(plan: BayesPlan, d: int, noise: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device ``d``'s minibatches, and its noise written into ``noise[j][step, personal_step, d]``,
    drawn in the order its own ``fit`` draws them (the sampler reshuffles from the same
    generator; ``normal_`` on a contiguous block draws what ``randn`` of its shape draws)."""
    dev, rows = plan.device, []
    for s in range(plan.steps):
        rows.append(dev.sampler.next())
        for k in range(plan.personal_steps):
            for n in noise:
                n[s, k, d].normal_(generator=dev.sampler.generator)
    return rows


def _run_group(plans: Sequence[BayesPlan], data: Any, loss_and_grad: Callable) -> list[tuple[NDArrays, int, dict[str, Scalar]]]:
    """pFedBayes's local iterations for devices with the same step counts and rates, stacked."""
    devices = [p.device for p in plans]
    first = plans[0]
    # every step's noise [steps, personal_steps, D, ...] per tensor, sent to the device at once
    noise = [torch.empty(first.steps, first.personal_steps, len(plans), *m.shape) for m in split(first.q)[0]]
    rows = [_draws(p, d, noise) for d, p in enumerate(plans)]
    scale = torch.tensor([p.noise_scale for p in plans])
    if not bool((scale == 1.0).all()):
        noise = [n * scale.view(1, 1, -1, *([1] * (n.dim() - 3))) for n in noise]  # fit's noise_scale * randn
    index, weight = pad_batches(rows, [data.offset[d.device_id] for d in devices], batch_width(devices))
    dev = data.device
    index, weight = index.to(dev), weight.to(dev)
    noise = [n.to(dev) for n in noise]
    mu_q, rho_q = split(stack([p.q for p in plans], dev))
    mu_v, rho_v = split(stack([p.v for p in plans], dev))
    kl_weight = torch.tensor([p.kl_weight for p in plans], device=dev)
    prior_rate = torch.tensor([p.lr * p.kl_weight for p in plans], device=dev)  # as fit's lr * kl_weight
    plr = first.personal_lr
    labels = labels_at(data, index)
    scaled = SCALED_STEPS.get(loss_and_grad)  # a closed form: its NLL targets (lr 1) made per block
    classes = mu_q[-1].shape[-1] if scaled is not None else None
    total = torch.zeros(len(plans), device=dev)
    steps_in = phase_steps(data, index, labels, weight, torch.ones(len(plans), device=dev), classes)
    sq = [softplus(r) for r in rho_q]  # kept from one personal step to the next, and for v's step
    for s, (x, target) in enumerate(steps_in):
        xt = x.transpose(1, 2) if scaled is not None else None
        sp = [softplus(r) for r in rho_v]  # v stays put during the personal steps
        sp2 = [p**2 for p in sp]
        for k in range(first.personal_steps):
            eps = [n[s, k] for n in noise]
            # fit's sample_weights, kl_grads and personal_step, each softplus / sigmoid taken
            # once: the same operations in the same order, so the same floats (+ and * commute
            # exactly), on temporaries updated in place (8 allocations a tensor a step, not 18)
            sig = [torch.sigmoid(r) for r in rho_q]
            sampled = [torch.mul(q, e).add_(m) for m, q, e in zip(mu_q, sq, eps, strict=True)]  # m + q * e
            if scaled is not None:
                loss, grad_w = scaled(sampled, x, xt, target)
            else:
                loss, grad_w = loss_and_grad(sampled, x, labels[s], weight[s])
            # zeta / n differs between devices: per-device factors on the KL gradients
            kl_mu = [torch.sub(mq, mv).div_(p2).mul_(per(kl_weight, mq))  # (mq - mv) / p2, scaled
                     for mq, mv, p2 in zip(mu_q, mu_v, sp2, strict=True)]
            kl_rho = [torch.div(q, p2).sub_(q.reciprocal()).mul_(g).mul_(per(kl_weight, q))  # (q / p2 - 1 / q) * g
                      for q, p2, g in zip(sq, sp2, sig, strict=True)]
            mu_q = [torch.sub(m, kk.add_(g).mul_(plr))  # m - plr * (g + kk)
                    for m, g, kk in zip(mu_q, grad_w, kl_mu, strict=True)]
            rho_q = [torch.sub(r, torch.mul(g, e).mul_(sg).add_(kk).mul_(plr))  # r - plr * (g * e * sg + kk)
                     for r, g, e, sg, kk in zip(rho_q, grad_w, eps, sig, kl_rho, strict=True)]
            sq = [softplus(r) for r in rho_q]
        total += loss
        g_mv, g_rv = prior_kl_grads(mu_q, mu_v, sq, sp, rho_v)
        mu_v, rho_v = prior_step(mu_v, rho_v, _scaled(prior_rate, g_mv), _scaled(prior_rate, g_rv), 1.0, 1.0)
    q = zip(*(t.cpu().unbind(0) for t in [*mu_q, *rho_q]), strict=True)
    v = zip(*(t.cpu().unbind(0) for t in [*mu_v, *rho_v]), strict=True)
    losses = (total / max(first.steps, 1)).cpu().tolist()
    replies = []
    for plan, q_d, v_d, loss_d in zip(plans, q, v, losses, strict=True):
        plan.device.personal = list(q_d)
        replies.append(fit_reply(plan.device, list(v_d), loss_d))
    return replies


def _scaled(values: torch.Tensor, grads: Params) -> Params:
    return [per(values, g) * g for g in grads]


class PFedBayesClient(DeviceClient):
    batched = True  # through its own group step (BayesPlan)
    bufferless = "treats every tensor as a Gaussian weight"

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> BayesPlan:
        dev = self.device
        v = to_tensors(parameters)
        q = list(dev.personal) if dev.personal is not None else list(v)
        return BayesPlan(dev, q, v, int(config["local_steps"]), int(config["personal_steps"]),
                         float(config["personal_lr"]), float(config["alpha"]), float(config["noise_scale"]),
                         float(config["zeta"]) / len(dev.y_train))

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        dev = self.device
        mu_v, rho_v = split(to_tensors(parameters))
        mu_q, rho_q = split(dev.personal) if dev.personal is not None else (list(mu_v), list(rho_v))
        kl_weight = float(config["zeta"]) / len(dev.y_train)
        plr, lr, scale = float(config["personal_lr"]), float(config["alpha"]), float(config["noise_scale"])
        losses = []
        for _ in range(int(config["local_steps"])):
            idx = dev.sampler.next()
            x, y = dev.x_train.index_select(0, idx), dev.y_train.index_select(0, idx)
            for _ in range(int(config["personal_steps"])):
                # eps from the device's batch generator: reproducible and saved with the device
                eps = [scale * torch.randn(m.shape, generator=dev.sampler.generator) for m in mu_q]
                loss, grad_w = dev.trainer.loss_and_grad(sample_weights(mu_q, rho_q, eps), x, y)
                g_mq, g_rq, _, _ = kl_grads(mu_q, rho_q, mu_v, rho_v)
                mu_q, rho_q = personal_step(mu_q, rho_q, grad_w, eps, g_mq, g_rq, plr, kl_weight)
            losses.append(float(loss))
            _, _, g_mv, g_rv = kl_grads(mu_q, rho_q, mu_v, rho_v)
            mu_v, rho_v = prior_step(mu_v, rho_v, g_mv, g_rv, lr, kl_weight)
        dev.personal = [*mu_q, *rho_q]
        return fit_reply(dev, [*mu_v, *rho_v], sum(losses) / max(len(losses), 1))

    def model_to_test(self, parameters: NDArrays, config: dict[str, Scalar]) -> Params:
        return split(super().model_to_test(parameters, config))[0]


def make_client(device: DeviceRuntime) -> PFedBayesClient:
    return PFedBayesClient(device)
