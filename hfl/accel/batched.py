"""Every sampled device of a node stepped as one computation (runtime.batched; issue 12).

A device client whose local work is "``steps`` minibatch steps of
``theta <- theta - lr * grad f(theta) - lr * prox * (theta - anchor)``" (plain SGD without an
anchor) describes a fit as a ``FitPlan``: one or more such ``Phase``s on its own sampler, and a
``finish`` that turns the trained models into its reply (and updates what it keeps). The
per-device path (``hfl.device.plan.run_plan``) runs a plan with
``hfl.device.training.run_local_steps``, exactly as the clients always did; the batched path (``run_plans``) runs the plans of all the devices a
node asked at once:

- parameters are stacked along a new leading device axis;
- each device still draws its own minibatches from its own sampler, in the same order, so the
  samplers end where the per-device path leaves them; a short last batch of an epoch is padded
  and the padding weighted 0, so every device's loss is the mean over its real samples;
- gradients come from a closed form where the model has one (hfl.accel.closed_forms: MCLR,
  one-hidden-layer ReLU nets; MCLR on devices with fewer samples than features in the dual
  form, hfl.accel.mclr_dual), else from ``torch.func.vmap(grad(...))`` over ``functional_call``;
- per-device learning rates, prox coefficients and anchors are tensors, so nothing assumes the
  devices received the same config.

A local loop of another form (Per-FedAvg's meta-steps, pFedBayes's sampled weights) comes as a
``GroupPlan`` whose class steps a group of devices together. Evaluation is batched likewise
(hfl.accel.batched_eval). Results equal the per-device path within
float tolerance (tests/test_batched.py), not bitwise: sums run in a different order. With
``runtime.device=cuda`` the data, the stacked models and all steps of a phase live on the GPU
(the minibatch indices of every step are drawn first and sent once); the models come back to
the host once per phase.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    NDArrays,
    Scalar,
    Status,
)
from flwr.server.client_proxy import ClientProxy
from torch.func import functional_call, grad_and_value, vmap

from hfl.accel.closed_forms import SCALED_STEPS, NLLTargets, closed_form, mclr_batched_loss_and_grad, nll_targets
from hfl.device.state import DeviceRuntime
from hfl.node.inprocess import call_fit
from hfl.node.lockstep import current_submit
from hfl.accel.mclr_dual import DualData, dual_buckets, dual_pays, make_dual_data, run_dual_steps, size_buckets
from hfl.models import MCLR
from hfl.rules.payload import LocalParameters, decode
from hfl.device.plan import FitPlan, FitReply, Phase
from hfl.device.training import LocalTrainer, Params, converted_once
from hfl.device.allocator import keep_freed_memory

class DeviceClientLike(Protocol):  # hfl.device.client.DeviceClient (which imports this module)
    device: DeviceRuntime

    def fit_plan(self, parameters: NDArrays, config: dict[str, Scalar]) -> FitPlan | GroupPlan | None: ...

    def tests_sent_model(self, config: dict[str, Scalar]) -> bool: ...

    def model_to_test(self, parameters: NDArrays, config: dict[str, Scalar]) -> Params: ...


class GroupPlan(Protocol):
    """A fit whose local work is not phases of prox-SGD (pFedBayes samples weights from a
    posterior): plans of one class with equal ``key()`` are stepped together by the class's
    ``run_together``, giving the same replies, in order, as each device's own ``fit`` within
    float tolerance."""

    def key(self) -> Hashable: ...

    @classmethod
    def run_together(cls, plans: Sequence[GroupPlan], data: ConcatenatedData,
                     loss_and_grad: Callable) -> list[FitReply]: ...


def resolve_device(setting: str) -> torch.device:
    """``runtime.device``: auto -> cuda when torch sees a GPU, else cpu."""
    setting = str(setting or "auto").lower()
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


# Measured on 2 CPU cores (docs/performance.md): batched MCLR and the synthetic DNN (1,430 parameters;
# both closed forms, hfl.accel.closed_forms) run 1.5-2.7x faster than one by one; MNIST's MLP (159,010)
# ran 1.1x slower batched, even in closed form (13.4 vs 11.7 s per PerMFL round), and vmap over
# its CNN 3.5x slower. On a GPU the batched path is the point.
CPU_VMAP_MAX_PARAMETERS = 50_000


def batching_pays(model: torch.nn.Module, device: torch.device) -> bool:
    """runtime.batched=auto's choice: on a GPU always; on the CPU for MCLR (whose step is cheap
    at any input size) and for small models, where one device's step is mostly Python overhead."""
    if device.type != "cpu" or type(model) is MCLR:
        return True
    return sum(p.numel() for p in model.parameters()) <= CPU_VMAP_MAX_PARAMETERS


# ------------------------------------------------------------------ stacked gradients
def functional_batched_loss_and_grad(trainer: LocalTrainer) -> Callable:
    """vmap over devices of grad_and_value of one device's weighted NLL (any model without buffers)."""
    names = trainer.names
    model = trainer.model

    def device_loss(params: Params, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, dict(zip(names, params, strict=True)), (x,))
        return (w * F.nll_loss(out, y, reduction="none")).sum()

    grads = vmap(grad_and_value(device_loss))

    def loss_and_grad(params: Params, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, Params]:
        g, loss = grads(list(params), x, y, w)
        return loss, list(g)

    return loss_and_grad


def batched_loss_and_grad(trainer: LocalTrainer) -> Callable:
    """A closed form where the architecture has one (hfl.accel.closed_forms), else vmap over autograd."""
    return closed_form(trainer.model) or functional_batched_loss_and_grad(trainer)


# ------------------------------------------------------------------ the batched path
# Nodes (and their BatchedFit / BatchedEvaluate) are rebuilt for every message; their devices'
# data tensors live on (the federation, or its lazy cache), so what a node makes of its devices'
# data (their concatenation, MCLR's dual-form data) is kept across messages, the most recent
# within this budget, each entry until one of its parts dies.
CONCAT_CACHE_BYTES = 512 * 2**20  # as much as the lazy device cache (dataset.cache_mb) keeps
# key -> (weak references to the parts, what was made of them, its bytes)
_KEPT: OrderedDict[tuple, tuple[list[weakref.ref], object, int]] = OrderedDict()
_KEPT_BYTES = [0]  # a running total: the weakref callback may fire at any moment, so nothing iterates the dict
T = TypeVar("T")


def _drop(key: tuple, out: object) -> None:
    entry = _KEPT.get(key)
    if entry is not None and entry[1] is out:
        del _KEPT[key]
        _KEPT_BYTES[0] -= entry[2]


_KEPT_LOCK = threading.Lock()  # a phase's size groups may ask from several threads (set_group_threads)


def kept(kind: str, parts: Sequence[torch.Tensor], device: torch.device, make: Callable[[], T],
         nbytes: Callable[[T], int]) -> T:
    """``make()``, made once for the same ``kind``, ``parts`` (the same tensor objects) and device."""
    with _KEPT_LOCK:
        return _kept(kind, parts, device, make, nbytes)


def _kept(kind: str, parts: Sequence[torch.Tensor], device: torch.device, make: Callable[[], T],
          nbytes: Callable[[T], int]) -> T:
    key = (kind, str(device), *map(id, parts))
    hit = _KEPT.get(key)
    if hit is not None and all(ref() is part for ref, part in zip(hit[0], parts, strict=True)):
        _KEPT.move_to_end(key)
        return hit[1]  # type: ignore[return-value]
    out = make()
    if hit is not None:  # a stale entry under a reused id
        _drop(key, hit[1])
    # a part is gone (its federation with it): so is the entry
    refs = [weakref.ref(part, lambda _, key=key, out=out: _drop(key, out)) for part in parts]
    size = nbytes(out)
    _KEPT[key] = (refs, out, size)
    _KEPT_BYTES[0] += size
    while _KEPT_BYTES[0] > CONCAT_CACHE_BYTES and len(_KEPT) > 1:
        _, (_, _, old) = _KEPT.popitem(last=False)
        _KEPT_BYTES[0] -= old
    return out


def concatenated(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``torch.cat(parts).to(device)``, made once for the same parts (``kept``)."""
    return kept("cat", parts, device, lambda: torch.cat(list(parts)).to(device), lambda t: t.nbytes)


class ConcatenatedData:
    """The training data of a node's devices, concatenated once on the compute device, with
    each device's offset into it."""

    def __init__(self, devices: Sequence[DeviceRuntime], device: torch.device) -> None:
        self.device = device
        self.x = concatenated([d.x_train for d in devices], device)
        self.y = concatenated([d.y_train for d in devices], device)
        sizes = [len(d.y_train) for d in devices]
        self.offset = {d.device_id: sum(sizes[:i]) for i, d in enumerate(devices)}
        self.size = {d.device_id: n for d, n in zip(devices, sizes, strict=True)}

    def dual(self, devices: Sequence[DeviceRuntime]) -> DualData | None:
        """MCLR's dual-form data of ``devices`` (hfl.accel.mclr_dual) when it pays, kept for later
        phases and messages of the same group (``kept``); None when the primal step is cheaper."""
        if not dual_pays([self.size[d.device_id] for d in devices], self.x[0].numel()):
            return None
        xs = [d.x_train for d in devices]
        return kept("dual", xs, self.device, lambda: make_dual_data(xs, self.device),
                    lambda dual: dual.x.nbytes + dual.gram.nbytes)


def batch_width(devices: Sequence[DeviceRuntime]) -> int:
    """The widest minibatch any of ``devices`` draws: a device with fewer samples than its batch
    size draws them all each step, so a group of small devices is not padded to the batch size."""
    return max(min(d.sampler.num_samples, d.sampler.batch_size) for d in devices)


def draw_batches(devices: Sequence[DeviceRuntime], offsets: Sequence[int], steps: int,
                 batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every step's minibatch of every device, from its own sampler (advanced exactly as the
    per-device path would): row indices into the concatenated data ``[steps, D, B]`` and the
    weights ``[steps, D, B]`` (1/len of the batch for real rows, 0 for padding)."""
    return pad_batches([dev.sampler.take(steps) for dev in devices], offsets, batch_size)


def pad_batches(drawn: Sequence[np.ndarray | torch.Tensor | Sequence[torch.Tensor]], offsets: Sequence[int],
                batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each device's minibatches (rows of its own data: a ``BatchSampler.take`` block, or a list of
    ``steps`` index tensors) as ``draw_batches`` returns them."""
    index = np.stack([_block(d, batch_size) for d in drawn], axis=1)  # [steps, D, B]
    at = np.asarray(offsets, dtype=np.int64).reshape(1, -1, 1)
    if (index[:, :, -1] >= 0).all():  # no short batch
        return torch.from_numpy(index + at), torch.full(index.shape, 1.0 / batch_size)
    # Short batches (an epoch's last; a device smaller than the group's width): padded with the
    # device's first row, weighted 0; the others 1/len (float32 division, as torch's). In place on
    # the stacked block: a phase of small devices pads every step.
    real = index >= 0
    weight = real.astype(np.float32)
    weight /= real.sum(2, keepdims=True, dtype=np.float32)
    np.maximum(index, 0, out=index)
    index += at
    return torch.from_numpy(index), torch.from_numpy(weight)


def _block(drawn: np.ndarray | torch.Tensor | Sequence[torch.Tensor], batch_size: int) -> np.ndarray:
    """``[steps, batch_size]``, -1 where a batch is short (columns past ``batch_size``, the group's
    ``batch_width``, hold only -1)."""
    if isinstance(drawn, torch.Tensor):
        drawn = drawn.numpy()
    elif not isinstance(drawn, np.ndarray):
        drawn = torch.nn.utils.rnn.pad_sequence(list(drawn), batch_first=True, padding_value=-1).numpy()
    if drawn.shape[1] > batch_size:
        drawn = drawn[:, :batch_size]
    elif drawn.shape[1] < batch_size:
        drawn = np.pad(drawn, ((0, 0), (0, batch_size - drawn.shape[1])), constant_values=-1)
    return drawn


def labels_at(data: ConcatenatedData, index: torch.Tensor) -> torch.Tensor:
    """The labels at rows ``index`` (any shape: one step's ``[D, B]``, a phase's ``[steps, D, B]``)."""
    return data.y.index_select(0, index.reshape(-1)).view(index.shape)


def minibatch(data: ConcatenatedData, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's inputs ``[D, B, ...]`` and labels ``[D, B]`` at rows ``index`` ``[D, B]``."""
    return data.x.index_select(0, index.reshape(-1)).view(*index.shape, *data.x.shape[1:]), labels_at(data, index)


# A phase's inputs (and a closed form's NLL targets) are made for several steps at once, up to
# this many bytes a block: one gather a block, not a step, and memory bounded however many
# devices, steps and classes a phase has. On the CPU a block small enough to stay in cache for the
# step's products that read it (this machine: 1 MiB L2, 32 MiB L3): 4 MiB against 32 took
# Synthetic MCLR PerMFL from 0.334-0.353 to 0.301-0.315 s/round, alternating runs; on a GPU
# fewer, larger gathers (launches).
GATHER_BYTES = 4 * 2**20
GATHER_BYTES_GPU = 32 * 2**20


def phase_steps(data: ConcatenatedData, index: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                lr: torch.Tensor, classes: int | None) -> Iterator[tuple[torch.Tensor, NLLTargets | None]]:
    """Each step's inputs at rows ``index`` ``[steps, D, B]`` and, for a closed form (``classes``
    given), its ``NLLTargets`` (labels and weights ``[steps, D, B]``, learning rates ``[D]``):
    inputs ``[D, B, features]`` then, else ``[D, B, ...]`` and no targets."""
    steps = index.shape[0]
    step_bytes = index[0].numel() * (data.x[0].numel() + (2 * classes + 1 if classes else 0)) * data.x.element_size()
    budget = GATHER_BYTES if data.device.type == "cpu" else GATHER_BYTES_GPU
    chunk = max(1, min(steps, budget // max(step_bytes, 1)))
    trailing = (-1,) if classes else tuple(data.x.shape[1:])
    for first in range(0, steps, chunk):
        block = slice(first, first + chunk)
        rows = index[block]
        xs = data.x.index_select(0, rows.reshape(-1)).view(*rows.shape, *trailing).unbind(0)
        yield from zip(xs, nll_targets(labels[block], weight[block], classes, lr) if classes else [None] * len(xs),
                       strict=True)


def per(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-device values ``[D]`` shaped to broadcast over a stacked tensor ``[D, ...]``."""
    return values.view(-1, *([1] * (like.dim() - 1)))


def stack(models: Sequence[Params], device: torch.device) -> Params:
    """Per-device tensors ``[D, ...]`` on ``device``. Tensors many devices hold alike (the team
    model its devices start from; a few teams' models when siblings fit merged) are sent once
    each, then broadcast (one alike) or gathered on ``device`` (a few): on a GPU host-to-device
    copies of D full models were the largest cost of a PerMFL CNN round. The broadcast views are
    read-only (every update is out of place; an in-place one raises). On the CPU, where nothing is
    sent, alike means the same tensor (no values compared: a merged phase of 4 teams' devices
    compared ~20 pairs a group)."""
    out = []
    by_value = device.type != "cpu"
    for i in range(len(models[0])):
        distinct, which = _distinct([m[i] for m in models], by_value)
        if len(distinct) == 1:
            out.append(distinct[0].to(device).unsqueeze(0).expand(len(models), *distinct[0].shape))
        elif len(distinct) < len(models):
            index = torch.tensor(which, device=device)
            out.append(torch.stack(distinct).to(device).index_select(0, index))
        else:
            out.append(torch.stack([m[i] for m in models]).to(device))
    return out


MAX_DISTINCT = 8  # beyond it, every tensor is taken as its own (checking costs more than it saves)


def _distinct(tensors: Sequence[torch.Tensor], by_value: bool = True) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct values among ``tensors`` (at most ``MAX_DISTINCT``, else all of them) and
    which one each tensor is; ``by_value`` false: the distinct tensor objects."""
    distinct: list[torch.Tensor] = []
    which: list[int] = []
    seen: dict[int, int] = {}  # id of a tensor met -> its value's position (a team's devices share one)
    for t in tensors:
        j = seen.get(id(t))
        if j is None:
            if by_value:  # a few leading values first: models that differ nearly always differ there
                j = next((k for k, u in enumerate(distinct)
                          if torch.equal(t.reshape(-1)[:8], u.reshape(-1)[:8]) and torch.equal(t, u)), None)
            if j is None:
                if len(distinct) == MAX_DISTINCT:
                    return list(tensors), list(range(len(tensors)))
                j = len(distinct)
                distinct.append(t)
            seen[id(t)] = j
        which.append(j)
    return distinct, which


def phase_buckets(data: ConcatenatedData, devices: Sequence[DeviceRuntime], loss_and_grad: Callable,
                  steps: int) -> list[list[int]]:
    """Positions of ``devices`` to step together for a phase of ``steps`` (inner steps counted):
    every device of a group is padded to its largest, in the dual form to the largest training set
    (``dual_buckets``), else to the widest minibatch (``size_buckets`` of ``batch_width``; on the
    CPU only: a GPU step costs about the same at any width)."""
    sizes = [data.size[d.device_id] for d in devices]
    if loss_and_grad is mclr_batched_loss_and_grad and dual_pays(sizes, data.x[0].numel()):
        return dual_buckets(sizes, max(d.sampler.batch_size for d in devices), steps)
    if data.device.type == "cpu":
        return size_buckets([batch_width([d]) for d in devices])
    return [list(range(len(devices)))]


# Threads stepping a phase's size groups at once on the CPU (runtime.batched_threads; 1: one
# after the other). Each group's operations run on torch's own threads (runtime.torch_threads):
# 2 and 1 fill two cores. The models do not depend on it: the groups share nothing.
class _GroupThreads:
    count = 1
    pool: ThreadPoolExecutor | None = None


def set_group_threads(threads: int) -> None:
    """How many of a phase's size groups step at once (``runtime.batched_threads``)."""
    if threads < 1:
        raise ValueError(f"runtime.batched_threads must be at least 1, got {threads}")
    if threads != _GroupThreads.count:
        if _GroupThreads.pool is not None:
            _GroupThreads.pool.shutdown(wait=False)
        _GroupThreads.count, _GroupThreads.pool = threads, None


def use_runtime_threads(runtime: Mapping) -> None:
    """A simulation's threads (its team actor's, or the in-process run's): torch's
    (``runtime.torch_threads``) and the size groups' (``runtime.batched_threads``, 1 if unset);
    and the heap kept between steps (hfl.device.allocator)."""
    keep_freed_memory()
    torch.set_num_threads(int(runtime["torch_threads"]))
    set_group_threads(int(runtime.get("batched_threads", 1)))


def _group_pool() -> ThreadPoolExecutor | None:
    if _GroupThreads.count == 1:
        return None
    if _GroupThreads.pool is None:
        _GroupThreads.pool = ThreadPoolExecutor(_GroupThreads.count, thread_name_prefix="hfl-group")
    return _GroupThreads.pool


def run_phase(data: ConcatenatedData, devices: Sequence[DeviceRuntime],
              phases: Sequence[Phase], loss_and_grad: Callable) -> tuple[list[Params], list[float]]:
    """One phase of every device's plan, stepped together in groups of similar sizes
    (``phase_buckets``), on the CPU several groups at once (``set_group_threads``); returns
    each device's model and mean loss."""
    buckets = phase_buckets(data, devices, loss_and_grad, phases[0].steps * phases[0].inner_steps)
    if len(buckets) == 1:
        return _step_together(data, devices, phases, loss_and_grad)

    def step(members: list[int]) -> tuple[list[Params], list[float]]:
        return _step_together(data, [devices[i] for i in members], [phases[i] for i in members], loss_and_grad)

    pool = _group_pool() if data.device.type == "cpu" else None
    if pool is None:
        results = [step(members) for members in buckets]
    else:  # the largest groups first, so that the last to start are short
        order = sorted(range(len(buckets)), key=lambda b: -len(buckets[b]) * max(
            data.size[devices[i].device_id] for i in buckets[b]))
        futures = {b: pool.submit(step, buckets[b]) for b in order}
        results = [futures[b].result() for b in range(len(buckets))]
    models: list[Params | None] = [None] * len(devices)
    losses: list[float] = [0.0] * len(devices)
    for members, got in zip(buckets, results, strict=True):
        for i, model, loss in zip(members, *got, strict=True):
            models[i], losses[i] = model, loss
    return models, losses  # type: ignore[return-value]


def _step_together(data: ConcatenatedData, devices: Sequence[DeviceRuntime], phases: Sequence[Phase],
                   loss_and_grad: Callable) -> tuple[list[Params], list[float]]:
    """One phase of ``devices`` as one computation. MCLR on devices with fewer samples than
    features steps in the dual form (hfl.accel.mclr_dual)."""
    dev = data.device
    steps = phases[0].steps
    if steps == 0:
        return [[p.clone() for p in ph.start] for ph in phases], [0.0] * len(phases)
    index, weight = draw_batches(devices, [data.offset[d.device_id] for d in devices], steps, batch_width(devices))
    index, weight = index.to(dev), weight.to(dev)
    theta = stack([ph.start for ph in phases], dev)
    lr = torch.tensor([ph.lr for ph in phases], device=dev)
    # An anchor with no pull on it (prox 0 and not moving: AL2GD's received model) changes nothing:
    # stepped without, the dual form needs neither its logits nor its coefficients.
    anchored = any(ph.anchor is not None and (ph.prox != 0.0 or ph.pull is not None) for ph in phases)
    if anchored:
        # PerMFL, FedProx...: the anchor is the start, already on the device
        anchor = theta if all(ph.anchor is None or ph.anchor is ph.start for ph in phases) else \
            stack([ph.anchor if ph.anchor is not None else ph.start for ph in phases], dev)
        lr_prox = torch.tensor([ph.lr * ph.prox if ph.anchor is not None else 0.0 for ph in phases], device=dev)
    pulled = phases[0].pull is not None  # the same for every phase run together (signature)
    if pulled:
        pull = torch.tensor([ph.pull for ph in phases], device=dev)
    labels = labels_at(data, index)
    dual = data.dual(devices) if loss_and_grad is mclr_batched_loss_and_grad else None
    if dual is not None:
        offsets = torch.tensor([data.offset[d.device_id] for d in devices], device=dev).view(1, -1, 1)
        theta, moved, total = run_dual_steps(dual, theta, anchor if anchored else None, index - offsets, weight,
                                             labels, lr, lr_prox if anchored else None, pull if pulled else None,
                                             phases[0].inner_steps)
        if pulled:
            anchor = moved
        return _per_device(phases, theta, anchor if pulled else None, total, steps)
    scaled = SCALED_STEPS.get(loss_and_grad)  # closed forms: lr * gradient, from targets made per block
    if scaled is None:
        lrs = [per(lr, t) for t in theta]
    if anchored:  # t <- (1 - lr*prox) t + lr*prox*anchor - lr*g
        keep = [per(1.0 - lr_prox, t) for t in theta]
        toward = [per(lr_prox, a) * a for a in anchor]
    total = torch.zeros(len(phases), device=dev)
    # the last parameter is the output bias [D, C]
    steps_in = phase_steps(data, index, labels, weight, lr, theta[-1].shape[-1] if scaled is not None else None)
    for s, (x, target) in enumerate(steps_in):
        xt = x.transpose(1, 2) if scaled is not None else None
        for _ in range(phases[0].inner_steps):
            if scaled is not None:
                loss, grads = scaled(theta, x, xt, target)
            else:
                loss, grads = loss_and_grad(theta, x, labels[s], weight[s])
                grads = [r * g for r, g in zip(lrs, grads, strict=True)]
            if anchored:
                theta = [torch.addcmul(c - g, k, t) for t, g, k, c in zip(theta, grads, keep, toward, strict=True)]
            else:
                theta = [t - g for t, g in zip(theta, grads, strict=True)]
        if pulled:
            anchor = [(1.0 - per(pull, a)) * a + per(pull, a) * t for a, t in zip(anchor, theta, strict=True)]
            toward = [per(lr_prox, a) * a for a in anchor]
        total.add_(loss.detach())
    return _per_device(phases, theta, anchor if pulled else None, total, steps)


def _per_device(phases: Sequence[Phase], theta: Params, moved: Params | None, total: torch.Tensor,
                steps: int) -> tuple[list[Params], list[float]]:
    """Stacked results back to each device (one op per tensor, not per device), on the host."""
    if moved is not None:
        for ph, anchor in zip(phases, zip(*(a.cpu().unbind(0) for a in moved), strict=True), strict=True):
            ph.moved_anchor = list(anchor)
    per_device = zip(*(t.cpu().unbind(0) for t in theta), strict=True)
    return [list(models) for models in per_device], (total / steps).cpu().tolist()


def signature(plan: FitPlan) -> tuple[tuple[int, int, bool], ...]:
    """Plans whose phases have the same steps, inner steps and pulls run together."""
    return tuple((ph.steps, ph.inner_steps, ph.pull is not None) for ph in plan.phases)


def run_plans(devices: Sequence[DeviceRuntime], plans: Sequence[FitPlan | GroupPlan],
              data: ConcatenatedData) -> list[FitReply]:
    """The batched path: the plans of ``devices`` (same architecture: one node's trainer), run
    phase by phase for all of them at once; each device's ``finish`` makes its reply. Plans of
    another kind (``GroupPlan``) are stepped together by their class."""
    if not devices:
        return []
    loss_and_grad = batched_loss_and_grad(devices[0].trainer)

    def key(i: int) -> Hashable:
        plan = plans[i]
        return signature(plan) if type(plan) is FitPlan else (type(plan), plan.key())

    def run_group(members: list[int]) -> list[FitReply]:
        kind = type(plans[members[0]])
        if kind is not FitPlan:
            return kind.run_together([plans[i] for i in members], data, loss_and_grad)
        group_devices = [devices[i] for i in members]
        results: list[tuple[list[Params], list[float]]] = [([], []) for _ in members]
        for p in range(len(plans[members[0]].phases)):
            models, losses = run_phase(data, group_devices, [plans[i].phases[p] for i in members], loss_and_grad)
            for r, (m, loss) in enumerate(zip(models, losses, strict=True)):
                results[r][0].append(m)
                results[r][1].append(loss)
        return [plans[i].finish(models, losses) for i, (models, losses) in zip(members, results, strict=True)]

    groups: dict[Hashable, list[int]] = {}
    for i in range(len(plans)):
        groups.setdefault(key(i), []).append(i)
    replies: list[FitReply | None] = [None] * len(plans)
    for members in groups.values():
        for i, reply in zip(members, run_group(members), strict=True):
            replies[i] = reply
    return replies  # type: ignore[return-value]


@dataclass
class PlanRequest:
    """A lowest node's batched fit, handed to the in-process lockstep (hfl.node.lockstep) to run with
    its siblings' (``run_plan_requests``)."""

    devices: Sequence[DeviceRuntime]
    plans: Sequence[FitPlan | GroupPlan]
    device: torch.device


def _architecture(request: PlanRequest) -> Hashable:
    model = request.devices[0].trainer.model
    return str(request.device), type(model), tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


# Merging pays where a step's fixed cost is a large part of it (tens of devices); past this many
# devices, or this much training data, nodes are stepped apart: 5 merged 700-device teams (3,500
# Synthetic devices in process) ran 3.8 s/round against 2.84 apart, their merged concatenation
# crowding the kept data (CONCAT_CACHE_BYTES) out every round.
MERGE_MAX_DEVICES = 256
MERGE_MAX_BYTES = CONCAT_CACHE_BYTES // 8


def _training_bytes(devices: Sequence[DeviceRuntime]) -> int:
    return sum(d.x_train.nbytes + d.y_train.nbytes for d in devices)


def mergeable(devices: Sequence[DeviceRuntime], plans: Sequence[FitPlan | GroupPlan]) -> bool:
    """Whether a node's fit may wait to be merged with its siblings' (else it runs at once, and
    its node need not stay built while the others catch up). Group plans run apart: pFedBayes's
    group step over MNIST's 4 teams merged ran 1.39 / 1.49 s/round against 1.19 / 1.26 apart
    (its sampled weights and gathers no longer fit in cache)."""
    return len(devices) <= MERGE_MAX_DEVICES and _training_bytes(devices) <= MERGE_MAX_BYTES and \
        all(type(plan) is FitPlan for plan in plans)


def merged_groups(requests: Sequence[PlanRequest]) -> list[list[int]]:
    """Positions of ``requests`` to run together: the same architecture and compute device, in
    order, each group within ``MERGE_MAX_DEVICES`` devices and ``MERGE_MAX_BYTES`` of training data
    (a larger request runs alone)."""
    open_groups: dict[Hashable, tuple[list[int], int, int]] = {}
    done: list[list[int]] = []
    for r, request in enumerate(requests):
        key = _architecture(request)
        size = len(request.devices)
        data = _training_bytes(request.devices)
        members, devices, nbytes = open_groups.get(key, ([], 0, 0))
        if members and (devices + size > MERGE_MAX_DEVICES or nbytes + data > MERGE_MAX_BYTES):
            done.append(members)
            members, devices, nbytes = [], 0, 0
        open_groups[key] = ([*members, r], devices + size, nbytes + data)
    return done + [members for members, _, _ in open_groups.values()]


def run_plan_requests(requests: Sequence[PlanRequest]) -> list[list[FitReply]]:
    """Several nodes' batched fits as one: the devices of the requests of each ``merged_groups``
    group go through ``run_plans`` together (its groups then span the nodes); each request gets
    its own devices' replies, in order."""
    out: list[list[FitReply]] = [[] for _ in requests]
    for members in merged_groups(requests):
        devices = [d for r in members for d in requests[r].devices]
        plans = [p for r in members for p in requests[r].plans]
        replies = run_plans(devices, plans, ConcatenatedData(devices, requests[members[0]].device))
        at = 0
        for r in members:
            out[r], at = replies[at:at + len(requests[r].devices)], at + len(requests[r].devices)
    return out


# ------------------------------------------------------------------ a lowest node's children
class BatchedFit:
    """What a lowest node calls instead of its devices' ``fit`` one by one
    (``hfl.node.inprocess.run_fit_rounds``'s ``fit_many``): the devices whose client returns a plan
    are stepped together; any other child (a dropped one, a client without a plan) is called as
    usual. Returns, per call, the FitRes or the exception the device raised."""

    def __init__(self, clients: Mapping[str, DeviceClientLike], proxies: dict[str, ClientProxy],
                 device: torch.device) -> None:
        # cid -> the NumPyClient behind proxies[cid]; only the called ones are looked up (a node's
        # mapping may build its devices when asked: hfl.runtime.build.NodeDevices)
        self.clients = clients
        self.proxies = proxies
        self.device = device
        self._data: ConcatenatedData | None = None

    def data(self, devices: Sequence[DeviceRuntime]) -> ConcatenatedData:
        """The training data of ``devices``: made at the first fit and kept for the node's later
        rounds while they ask no device outside it (a sampled round asks others: made again)."""
        if self._data is None or any(d.device_id not in self._data.offset for d in devices):
            self._data = ConcatenatedData(devices, self.device)
        return self._data

    def __call__(self, calls: Sequence[tuple[ClientProxy, FitIns]]) -> list[FitRes | BaseException]:
        outcomes: list[FitRes | BaseException | None] = [None] * len(calls)
        planned: list[tuple[int, DeviceClientLike, FitPlan | GroupPlan]] = []
        decoded: dict[int, NDArrays] = {}  # a strategy sends every device the same Parameters
        converted: dict = {}  # ... and its arrays become tensors once (hfl.device.training.converted_once)
        for i, (proxy, ins) in enumerate(calls):
            # The proxy first: a dropped device's client need not be built (hfl.runtime.build.NodeDevices).
            client = self.clients.get(proxy.cid) if self.proxies.get(proxy.cid) is proxy else None
            if client is None:
                outcomes[i] = call_fit(proxy, ins)  # e.g. a DroppedProxy: raises like a dead device
                continue
            try:
                key = id(ins.parameters)
                if key not in decoded:
                    decoded[key] = decode(ins.parameters)
                with converted_once(converted):  # not around call_fit: a device's own fit
                    plan = client.fit_plan(decoded[key], dict(ins.config))
            except Exception as exc:  # noqa: BLE001 - the device fails, as its fit would
                outcomes[i] = exc
                continue
            if plan is None:
                outcomes[i] = call_fit(proxy, ins)
            else:
                planned.append((i, client, plan))
        if planned:
            try:
                devices = [c.device for _, c, _ in planned]
                plans = [p for _, _, p in planned]
                # in process, with the node's siblings (hfl.node.lockstep) where merging may pay
                submit = current_submit() if mergeable(devices, plans) else None
                replies = submit(PlanRequest(devices, plans, self.device)) if submit is not None else \
                    run_plans(devices, plans, self.data(devices))
            except Exception as exc:  # noqa: BLE001 - a failed batched step fails every device in it
                replies = [exc] * len(planned)
            for (i, _, _), reply in zip(planned, replies, strict=True):
                outcomes[i] = reply if isinstance(reply, BaseException) else fit_res(reply)
        return outcomes  # type: ignore[return-value]


def fit_res(reply: FitReply) -> FitRes:
    """A device's (arrays, num_examples, metrics) as the FitRes Flower's NumPyClient would make."""
    arrays, num_examples, metrics = reply
    return FitRes(Status(Code.OK, "Success"), LocalParameters(arrays), int(num_examples), dict(metrics))
