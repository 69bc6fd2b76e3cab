"""PFLEGO (seeds/004; ../shared/notes/pflego.md): exact distributed SGD on a shared body theta,
with a personal linear head W_i (K_i x (M+1), bias column) that never leaves device i.

Round t, with r of the I devices drawn uniformly across the tree (``algorithm.sampling=devices``):
- device i: features of theta computed once; tau-1 full-batch head steps (lr beta) on them; at
  step tau the joint gradient (g_W, g_theta) at the same point; W_i <- W_i - rho (I/r) g_W
  (eq. 3); it sends g_theta and N_i, never weights (clients.pflego).
- an inner node: the N_i-weighted mean of its children's gradients, with N = the sum behind it,
  so that every level's mean composes into the flat one exactly;
- the root: ``sgd`` is the paper's eq. 4, theta <- theta - rho (I/r) sum_sampled (N_i / N_all) g_i;
  ``adam`` (the authors' code) feeds (I/r) sum_sampled (N_i / N_sampled) g_i to Adam(lr rho).

The pure rules come first; the Flower servers below only wire them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional  # noqa: UP035 - OmegaConf reads typing.List/Optional
from collections.abc import Mapping, Sequence

from omegaconf import MISSING
import numpy as np
import torch
import torch.nn.functional as F
from flwr.common import NDArrays, Scalar

from hfl.config.schema import HierFAVGConfig
from hfl.rules import nodeopt
from hfl.data.federation import device_sizes
from hfl.errors import ConfigError
from hfl.models import build_model
from hfl.algorithm import NodeContext, Replies, ServerRule, model_from_state
from hfl.data.labels import model_classes
from hfl.rules.fit_testing import DevicesOwnTest
from hfl.rules.personal import check_keys, head_mask
from hfl.tree.sampling import sample_size


OPTIMIZERS = ("adam", "sgd")
OPT = "opt."  # the root's optimiser state in its stored state
# The authors' Adam (optax defaults); nodeopt's bias-corrected step puts eps inside the corrected
# rate (Kingma & Ba's "efficient" form), which differs from optax only in eps' scale.
ADAM = {"optimizer": "adam", "beta1": 0.9, "beta2": 0.999, "tau": 1e-8, "bias_correction": True}


# ---------------------------------------------------------------- rules (pure)
def with_bias(features: torch.Tensor) -> torch.Tensor:
    """[phi, 1]: the features with the bias column the head's last column multiplies."""
    return torch.cat([features, features.new_ones(features.shape[0], 1)], dim=1)


def head_loss_and_grad(head: torch.Tensor, feats1: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean cross-entropy of the linear head on [phi, 1] and its exact gradient
    (softmax - onehot)^T [phi, 1] / N, without autograd."""
    logits = feats1 @ head.t()
    loss = float(F.cross_entropy(logits, y))
    g = torch.softmax(logits, dim=1)
    g[torch.arange(len(y)), y] -= 1.0
    return loss, g.t() @ feats1 / len(y)


def head_steps(head: torch.Tensor, feats1: torch.Tensor, y: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
    """``steps`` full-batch gradient steps on the head alone, the body's features fixed."""
    for _ in range(steps):
        head = head - lr * head_loss_and_grad(head, feats1, y)[1]
    return head


def device_round(
    body, theta: Sequence[torch.Tensor], head: torch.Tensor, x: torch.Tensor, y: torch.Tensor,  # noqa: ANN001
    tau: int, client_lr: float, head_lr: float,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, float]:
    """One device's round: (g_theta, g_W, the new head, the loss at the joint point).

    ``body(theta, x)`` returns the features; it runs forward once and backward once whatever
    tau is: the tau-1 head steps reuse the features, and the joint gradient differentiates the
    same graph at step tau (theta has not moved)."""
    leaves = [t.detach().requires_grad_(True) for t in theta]
    feats1 = with_bias(body(leaves, x))
    head = head_steps(head, feats1.detach(), y, client_lr, tau - 1)
    loss, g_head = head_loss_and_grad(head, feats1.detach(), y)
    joint = F.cross_entropy(feats1 @ head.t(), y)
    g_theta = list(torch.autograd.grad(joint, leaves))
    return g_theta, g_head, head - head_lr * g_head, loss


def initial_head(num_classes: int, feature_dim: int, seed: int) -> torch.Tensor:
    """W_i^0 ~ U[0, 1), K_i x (M+1), as the paper and the authors' code."""
    return torch.rand(num_classes, feature_dim + 1, generator=torch.Generator().manual_seed(seed))


def split_head(head: torch.Tensor) -> list[torch.Tensor]:
    """[weight, bias] of ``nn.Linear`` from the K x (M+1) head."""
    return [head[:, :-1], head[:, -1]]


def gradient_step_scale(sampled_examples: float, total_examples: float, num_devices: int, num_sampled: int) -> float:
    """Eq. 4's factor on the N-weighted mean of the sampled gradients: (I/r) * N_sampled / N_all,
    so that scale * mean = (I/r) sum_sampled (N_i / N_all) g_i."""
    return num_devices / num_sampled * sampled_examples / total_examples


def root_step(
    optimizer: Mapping[str, Any], theta: NDArrays, mean_grad: NDArrays, scale: float, state: Mapping[str, np.ndarray]
) -> tuple[NDArrays, dict[str, np.ndarray]]:
    """theta after the root's step on ``scale * mean_grad``: plain sgd (eq. 4), or Adam through
    hfl.rules.nodeopt (whose pseudo-gradient target - theta is then minus the gradient)."""
    step = [scale * g for g in mean_grad]
    if optimizer["optimizer"] == "sgd":
        return [t - optimizer["lr"] * g for t, g in zip(theta, step, strict=True)], dict(state)
    return nodeopt.apply(optimizer, theta, [t - g for t, g in zip(theta, step, strict=True)], state)


# ---------------------------------------------------------------- config
def check_config(alg: Mapping[str, Any]) -> None:
    check_keys(alg, server_lr={"minimum": 0, "open_min": True}, local_steps={"integer": True, "minimum": 1})
    if alg.get("server_optimizer") not in OPTIMIZERS:
        raise ConfigError("algorithm.server_optimizer",
                          f"unknown {alg.get('server_optimizer')!r}; known: {', '.join(OPTIMIZERS)}")
    fixed = {"sampling": "devices", "local_labels": True, "weighted": True, "team_rounds": 1}
    for key, value in fixed.items():
        if alg.get(key) != value:
            raise ConfigError(f"algorithm.{key}", f"PFLEGO needs {value!r} here, got {alg.get(key)!r}")
    if alg["level_rounds"] is not None and any(int(r) != 1 for r in alg["level_rounds"]):
        raise ConfigError("algorithm.level_rounds", "PFLEGO takes one step per global round: every entry must be 1")


def check_federation(cfg: Mapping[str, Any], fed) -> None:  # noqa: ANN001 - hfl.data.Federation
    model = build_model(cfg["model"], fed.input_shape, model_classes(cfg["algorithm"]["local_labels"], fed, PflegoServer.personal_heads))
    if not (hasattr(model, "body") and hasattr(model, "head") and hasattr(model, "feature_dim")):
        raise ConfigError("model.name", f"PFLEGO needs a body and a linear head (model=mlp, pflego_cnn or conv4); "
                                        f"{cfg['model']['name']!r} has none")


def optimizer_spec(alg: Mapping[str, Any]) -> dict:
    if alg["server_optimizer"] == "sgd":
        return {"optimizer": "sgd", "lr": float(alg["server_lr"])}
    return nodeopt.check_spec("algorithm.server_lr", {**ADAM, "lr": float(alg["server_lr"])})


def body_arrays(arrays: NDArrays, names: Sequence[str]) -> NDArrays:
    """The exchanged part of a full model: every tensor but the head's."""
    return [a for a, head in zip(arrays, head_mask(names, 1), strict=True) if not head]


def num_sampled(sample_fraction: float, num_devices: int) -> int:
    return sample_size(num_devices, float(sample_fraction))


# ---------------------------------------------------------------- the server
@dataclass
class PFLEGOConfig(HierFAVGConfig):
    """PFLEGO's keys (conf/algorithm/pflego.yaml), registered as /schema/algorithm/pflego from here."""

    local_labels: bool = MISSING
    sampling: str = MISSING  # children | devices
    sample_fraction: Any = MISSING  # a number or a list, root first
    server_lr: float = MISSING
    server_optimizer: str = MISSING  # adam | sgd
    level_rounds: Optional[List[int]] = MISSING
    fit_test: bool = MISSING


class PflegoServer(DevicesOwnTest, ServerRule):
    """An inner node: the N-weighted mean of its children's gradients (its reply is a gradient).
    The root: its optimiser's step on the sampled devices' gradients (adam or eq. 4's sgd), on
    the body alone, the optimiser's state kept in the store with it."""

    schema = PFLEGOConfig  # its keys' types, registered from here (hfl.config.schema.algorithm_schemas)
    reply_kind = "gradient"  # servers relay gradients, not models
    personalized = True  # PM = the root's body + the device's own head
    global_model = False  # the root's body has no head: no model of its own to test
    level_models = False  # servers relay gradients, not models
    pm_base = "gm"  # evaluation sends the root's body; each device completes it with its head
    any_depth = True  # N-weighted means of gradients: on any tree the root's step is the flat one
    personal_heads = True  # each head has its device's K_i, so devices may own different numbers of classes

    check_config = staticmethod(check_config)  # the module's checks, above
    check_federation = staticmethod(check_federation)

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self._load_fit_test(ctx.state, ctx.is_root)  # the paper's figure (hfl.rules.fit_testing)
        self.num_devices = len(ctx.fed.devices) if ctx.fed is not None else 0
        if ctx.is_root:
            self.optimizer = optimizer_spec(vars(ctx.params))
            self.num_sampled = num_sampled(ctx.params.sample_fraction, self.num_devices)
            self._total_examples: int | None = None  # summed when first needed (server_optimizer=sgd)
            stored = {k[len(OPT):]: v for k, v in (ctx.state or {}).items() if k.startswith(OPT)}
            self.opt_state: dict[str, np.ndarray] = stored or nodeopt.init_state([])

    @property
    def total_examples(self) -> int:
        """Every device's training samples (eq. 4's N): summed once, from the size draws alone on a
        lazy federation (hfl.data.federation.device_sizes), and only by the sgd step that reads it."""
        if self._total_examples is None:
            self._total_examples = sum(device_sizes(self.ctx.fed, d)[0] for d in range(self.num_devices))
        return self._total_examples

    def start(self) -> NDArrays:
        if not self.ctx.is_root:
            return super().start()
        ctx = self.ctx
        stored = model_from_state(ctx.state)
        if stored is not None:
            return stored
        model = build_model(ctx.run.model, ctx.fed.input_shape,
                            model_classes(ctx.params.local_labels, ctx.fed, PflegoServer.personal_heads))
        return body_arrays(ctx.payload.main, [n for n, _ in model.named_parameters()])

    def fit_config(self) -> dict[str, Scalar]:
        p = self.params
        head_lr = p.server_lr * self.num_devices / num_sampled(p.sample_fraction, self.num_devices)
        return {"alpha": p.alpha, "local_steps": p.local_steps, "head_lr": head_lr,
                "seed": self.ctx.run.seed, "fit_test": p.fit_test}

    def aggregate(self, model: NDArrays, replies: Replies) -> NDArrays:
        mean = replies.mean()
        if not self.ctx.is_root:
            return mean
        self._record_fit_test(replies)
        if self.optimizer["optimizer"] == "sgd":
            scale = gradient_step_scale(sum(replies.weights), self.total_examples, self.num_devices, self.num_sampled)
        else:  # the authors' code: alpha normalised over the sampled devices, times I/r
            scale = self.num_devices / self.num_sampled
        theta, self.opt_state = root_step(self.optimizer, model, mean, scale, self.opt_state)
        return theta

    def state(self) -> dict[str, np.ndarray]:
        if not self.ctx.is_root:
            return {}
        return {**{f"{OPT}{k}": v for k, v in self.opt_state.items()}, **self._fit_test_state()}

    def evaluation_metrics(self, model: NDArrays) -> dict[str, float]:
        return self._fit_test_metrics()


SERVER = PflegoServer
