"""PerMFL's CNN (``hfl.models.CNN``) for D devices at once, written out: each convolution is one
grouped convolution (a group per device, the devices side by side in the channels), the linear
layers are batched products, and autograd runs through the sum of the devices' losses (a
device's loss depends on its own parameters only, so that gradient is each device's own).

It replaces ``torch.func.vmap`` over the module, which lays the same grouped convolutions out in
NCHW: on an H100, 45–49% of a vmapped step was cuDNN transposing layouts in their backward pass.
Here the activations are channels-last. One step of 40 devices x 124 MNIST images took 16.6 ms
on an H100 against 27.8 through vmap, its gradients within 4.3e-7 (relative) of vmap's with TF32
off (``benchmarks/cnn_step.py``). Channels-last pays on the CPU too: 0.14 s a device step on one
thread against 0.19 for this code in NCHW (measured once, by hand, 4 devices).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Params = list[torch.Tensor]


def cnn_batched_log_probs(params: Params, x: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``[D, B, classes]`` of D stacked CNNs (parameters ``[D, ...]`` in
    ``CNN.parameters()`` order) on inputs ``[D, B, C, H, W]``."""
    conv1_w, conv1_b, conv2_w, conv2_b, fc1_w, fc1_b, fc2_w, fc2_b = params
    devices, batch = x.shape[:2]
    h = x.transpose(0, 1).reshape(batch, devices * x.shape[2], *x.shape[3:])  # [B, D*C, H, W]
    h = h.contiguous(memory_format=torch.channels_last)
    for weight, bias in ((conv1_w, conv1_b), (conv2_w, conv2_b)):
        kernel = weight.flatten(0, 1).contiguous(memory_format=torch.channels_last)
        h = F.max_pool2d(torch.relu(F.conv2d(h, kernel, bias.flatten(), groups=devices)), 2, stride=1)
    # each device's features in CNN.forward's flatten order (C, H, W)
    h = h.contiguous().view(batch, devices, -1).transpose(0, 1)
    h = torch.relu(torch.baddbmm(fc1_b.unsqueeze(1), h, fc1_w.transpose(1, 2)))
    return torch.log_softmax(torch.baddbmm(fc2_b.unsqueeze(1), h, fc2_w.transpose(1, 2)), dim=-1)


def cnn_batched_loss_and_grad(params: Params, x: torch.Tensor, y: torch.Tensor,
                              w: torch.Tensor) -> tuple[torch.Tensor, Params]:
    """Each device's weighted NLL ``[D]`` (weights ``w`` ``[D, B]``, 0 on padding) and its
    gradient, stacked like ``params``."""
    with torch.enable_grad():
        leaves = [p.detach().requires_grad_() for p in params]
        log_probs = cnn_batched_log_probs(leaves, x)
        nll = F.nll_loss(log_probs.flatten(0, 1), y.flatten(), reduction="none").view_as(w)
        losses = (w * nll).sum(1)
        grads = torch.autograd.grad(losses.sum(), leaves)
    return losses.detach(), list(grads)
