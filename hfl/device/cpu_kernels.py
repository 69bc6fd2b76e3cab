"""A model's layers run on the CPU kernels that suit a device's small batches, with the same bits.

PyTorch's CPU max-pooling of a contiguous (channels-first) batch walks each window element by
element: for hfl's MNIST CNN at batch 10 (two 2x2 pools at stride 1) that was 1.4 and 2.5 ms a
forward pass, a third of the whole training step (profiled with torch.profiler, 1 thread,
torch 2.14). Its channels-last kernel takes 0.15-0.18 ms for the same windows, with the same tie
rule (the first maximum in window order) and the same order of accumulation in the backward pass
(output positions in order), so values and gradients are bitwise equal
(tests/test_cpu_kernels.py). ``fast_cpu_layers`` gives the trainer a copy of the model whose
``nn.MaxPool2d`` layers pool that way on the CPU; other devices and every other layer are unchanged.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

_CHANNELS_LAST = torch.channels_last


class _ChannelsLastMaxPool(torch.autograd.Function):
    """``F.max_pool2d`` of a channels-first batch, computed by the channels-last kernels; the
    output and the input's gradient channels-first again (so the layers around it keep their
    fast contiguous kernels)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel: Any, stride: Any, padding: Any, dilation: Any,
                ceil_mode: bool) -> torch.Tensor:
        x_cl = x.contiguous(memory_format=_CHANNELS_LAST)
        out, indices = torch.ops.aten.max_pool2d_with_indices(x_cl, kernel, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(x_cl, indices)
        ctx.pool = (kernel, stride, padding, dilation, ceil_mode)
        return out.contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_cl, indices = ctx.saved_tensors
        grad_in = torch.ops.aten.max_pool2d_with_indices_backward(
            grad.contiguous(memory_format=_CHANNELS_LAST), x_cl, *ctx.pool, indices)
        return grad_in.contiguous(), None, None, None, None, None


def _pair(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)] * 2


class CpuMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` that pools a contiguous 4-d CPU batch with the channels-last kernel
    (module docstring); anything else (a GPU, a channels-last or 3-d input) as its parent does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dim() != 4 or not x.is_contiguous() or x.is_contiguous(memory_format=_CHANNELS_LAST):
            return super().forward(x)
        kernel = _pair(self.kernel_size)
        stride = _pair(self.stride if self.stride is not None else self.kernel_size)
        return _ChannelsLastMaxPool.apply(x, kernel, stride, _pair(self.padding), _pair(self.dilation), self.ceil_mode)


def _swappable(module: nn.Module) -> bool:
    return type(module) is nn.MaxPool2d and not module.return_indices


def fast_cpu_layers(model: nn.Module) -> nn.Module:
    """``model`` itself when nothing in it has a faster CPU form, else a copy whose plain
    ``nn.MaxPool2d`` layers are ``CpuMaxPool2d`` (same parameters, buffers, class and outputs)."""
    if not any(_swappable(m) for m in model.modules()):
        return model
    fast = copy.deepcopy(model)
    for parent in list(fast.modules()):
        for name, child in list(parent.named_children()):
            if _swappable(child):
                pool = CpuMaxPool2d(child.kernel_size, child.stride, child.padding, child.dilation,
                                    return_indices=False, ceil_mode=child.ceil_mode)
                pool.train(child.training)
                setattr(parent, name, pool)
    return fast
