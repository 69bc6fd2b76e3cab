"""The papers' models, built from the dataset's input shape and class count."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from hfl.errors import ConfigError


class MCLR(nn.Module):
    """Multinomial logistic regression: Linear(d -> C) with log-softmax outputs."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc(x.flatten(1)), dim=1)


class DNN(nn.Module):
    """PerMFL's synthetic-data network: d -> hidden -> ReLU -> C."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int = 20) -> None:
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc2(torch.relu(self.fc1(x.flatten(1)))), dim=1)


class CNN(nn.Module):
    """PerMFL's image CNN: two 2x2 convs, each followed by ReLU and a stride-1 max-pool."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int = 128) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError("model.name", f"cnn needs image inputs (C, H, W), got shape {tuple(input_shape)}")
        channels, height, width = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, kernel_size=2), nn.ReLU(), nn.MaxPool2d(2, stride=1),
            nn.Conv2d(16, 32, kernel_size=2), nn.ReLU(), nn.MaxPool2d(2, stride=1),
        )
        # Each conv (k=2) and each pool (k=2, s=1) shrinks a side by one: 28 -> 24 for MNIST.
        flat = 32 * (height - 4) * (width - 4)
        self.fc1 = nn.Linear(flat, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x).flatten(1)
        return torch.log_softmax(self.fc2(torch.relu(self.fc1(h))), dim=1)


MODELS = {"mclr": MCLR, "dnn": DNN, "cnn": CNN}


def build_model(model_cfg: Mapping, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Instantiate ``model_cfg['name']`` for the given input shape and class count."""
    name = model_cfg.get("name")
    if name not in MODELS:
        raise ConfigError("model.name", f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    kwargs = {k: v for k, v in model_cfg.items() if k != "name"}
    return MODELS[name](tuple(input_shape), int(num_classes), **kwargs)


def mclr_loss_and_grad(
    params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Mean NLL of MCLR and its exact gradient, without autograd.

    d/dlogits of mean NLL(log_softmax) is (softmax - onehot) / B; it saves the autograd
    graph on the hottest path of the MCLR experiments (tested against autograd).
    """
    weight, bias = params
    x = x.flatten(1)
    logp = torch.log_softmax(torch.addmm(bias, x, weight.t()), dim=1)
    batch = x.shape[0]
    loss = -logp.gather(1, y.unsqueeze(1)).mean()
    g = logp.exp_()
    g[torch.arange(batch), y] -= 1.0
    g.div_(batch)
    return loss.detach(), [g.t().mm(x), g.sum(0)]


# Closed-form gradients for models where they exist; others use autograd.
FAST_GRADIENTS = {MCLR: mclr_loss_and_grad}
