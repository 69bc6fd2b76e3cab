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


def _image_shape(name: str, input_shape: Sequence[int]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError("model.name", f"{name} needs image inputs (C, H, W), got shape {tuple(input_shape)}")
    channels, height, width = (int(v) for v in input_shape)
    return channels, height, width


class BodyHead(nn.Module):
    """A feature extractor ``body`` (flat features of size ``feature_dim``) under a linear ``head``.

    The head is registered last, so its tensors are the last two parameters
    (``hfl.rules.personal.head_mask(names, 1)`` selects them): PFLEGO-style algorithms keep it personal.
    """

    def __init__(self, body: nn.Sequential, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.body = body
        self.feature_dim = feature_dim
        self.head = nn.Linear(feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head(self.body(x)), dim=1)


class MLP(BodyHead):
    """PFLEGO's MNIST network: Flatten -> Linear(d -> hidden) -> ReLU, then the head."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int = 200) -> None:
        body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU())
        super().__init__(body, hidden, num_classes)


class PflegoCNN(BodyHead):
    """PFLEGO's CIFAR-10 network: two [Conv 5x5 (64, same) -> ReLU -> MaxPool 3x3 s2 p1] blocks,
    then Linear 384 -> ReLU -> Linear 192 -> ReLU, then the head."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        channels, height, width = _image_shape("pflego_cnn", input_shape)

        def pooled(side: int) -> int:  # MaxPool2d(3, stride=2, padding=1): ceil(side / 2)
            return (side + 2 - 3) // 2 + 1

        flat = 64 * pooled(pooled(height)) * pooled(pooled(width))
        body = nn.Sequential(
            nn.Conv2d(channels, 64, kernel_size=5, padding="same"), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1),
            nn.Conv2d(64, 64, kernel_size=5, padding="same"), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1),
            nn.Flatten(),
            nn.Linear(flat, 384), nn.ReLU(),
            nn.Linear(384, 192), nn.ReLU(),
        )
        super().__init__(body, 192, num_classes)


class Conv4(BodyHead):
    """PFLEGO's Omniglot network: four [Conv 3x3 (64, pad 1) -> ReLU -> MaxPool 2] blocks, flattened
    (64 features for 28x28 inputs), then the head."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        channels, height, width = _image_shape("conv4", input_shape)
        # Each block keeps the side through the conv and floors it by 2 in the pool.
        if min(height, width) < 16:
            raise ConfigError(
                "model.name", f"conv4 halves each side four times and needs H, W >= 16, got {tuple(input_shape)}"
            )
        blocks: list[nn.Module] = []
        for i in range(4):
            blocks += [nn.Conv2d(channels if i == 0 else 64, 64, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        body = nn.Sequential(*blocks, nn.Flatten())
        super().__init__(body, 64 * (height // 16) * (width // 16), num_classes)


class LeNet(BodyHead):
    """The B-HFL prototype's FEMNIST network (../shared/notes/bhfl.md): Conv 5x5 (6) -> MaxPool 2 ->
    Conv 5x5 (16) -> MaxPool 2, flattened (256 features for 28x28 inputs), Linear 120 -> Linear 84,
    then the head. The notes give the layer sizes only: ReLU after each conv and hidden linear layer
    and max pooling are assumed (LeNet-style as PyTorch writes it), no padding."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        channels, height, width = _image_shape("lenet", input_shape)
        if min(height, width) < 16:  # 5x5 conv, pool, 5x5 conv, pool: (side - 4) // 2 - 4 must be >= 2
            raise ConfigError("model.name", f"lenet needs H, W >= 16, got {tuple(input_shape)}")
        flat = 16 * (((height - 4) // 2 - 4) // 2) * (((width - 4) // 2 - 4) // 2)
        body = nn.Sequential(
            nn.Conv2d(channels, 6, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(flat, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
        )
        super().__init__(body, 84, num_classes)


class BasicBlock(nn.Module):
    """ResNet's basic block: conv3x3-BN-ReLU-conv3x3-BN plus the shortcut (identity, or a
    1x1 conv + BN where the stride or width changes), then ReLU. Convolutions have no bias."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet9(BodyHead):
    """The FeMAM authors' "ResNet-9": stem conv3x3 (-> 8) + BN + ReLU, one BasicBlock per stage
    (widths 8/16/32/64, strides 1/2/2/2), global average pooling (their avg-pool(4) on 32x32
    inputs; adaptive, so 28x28 works too), then the linear head 64 -> classes (83,852
    parameters on 3x32x32 inputs with 100 classes). Has BatchNorm: its running statistics are
    buffers, not parameters; hfl.device.training.LocalTrainer carries them beside the parameters (sent
    and averaged like a state_dict, never stepped by gradients)."""

    WIDTHS = (8, 16, 32, 64)
    STRIDES = (1, 2, 2, 2)

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        channels, _, _ = _image_shape("resnet9", input_shape)
        layers: list[nn.Module] = [nn.Conv2d(channels, self.WIDTHS[0], 3, padding=1, bias=False),
                                   nn.BatchNorm2d(self.WIDTHS[0]), nn.ReLU()]
        width = self.WIDTHS[0]
        for out, stride in zip(self.WIDTHS, self.STRIDES, strict=True):
            layers.append(BasicBlock(width, out, stride))
            width = out
        body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        super().__init__(body, width, num_classes)


MODELS = {"mclr": MCLR, "dnn": DNN, "cnn": CNN, "mlp": MLP, "pflego_cnn": PflegoCNN, "conv4": Conv4,
          "resnet9": ResNet9, "lenet": LeNet}


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
