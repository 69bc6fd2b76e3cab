"""Every device of a lowest node tested in one batched computation (runtime.batched; issue 12):
the evaluation counterpart of hfl.accel.batched. Scores equal ``LocalTrainer.evaluate`` per device
within float tolerance (tests/test_batched.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from flwr.common import Code, EvaluateRes, Parameters, Status
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from torch.func import functional_call, vmap

from hfl.accel.batched import DeviceClientLike, concatenated, stack
from hfl.device.state import DeviceRuntime
from hfl.node.inprocess import evaluate_child
from hfl.accel.mclr_dual import size_buckets
from hfl.rules.payload import decode, payload_nbytes
from hfl.accel.grouped_cnn import cnn_batched_log_probs
from hfl.models import CNN, MCLR
from hfl.device.training import LocalTrainer, Params, to_tensors


def batched_log_probs(trainer: LocalTrainer) -> Callable[[Params, torch.Tensor], torch.Tensor]:
    """Stacked models ``[D, ...]`` on inputs ``[D, N, ...]`` -> log-probabilities ``[D, N, C]``."""
    if type(trainer.model) is MCLR:
        def mclr(params: Params, x: torch.Tensor) -> torch.Tensor:
            weight, bias = params
            logits = torch.baddbmm(bias.unsqueeze(2), weight, x.flatten(2).transpose(1, 2))  # [D, C, N]: faster
            return torch.log_softmax(logits, dim=1).transpose(1, 2).contiguous()
        return mclr
    if type(trainer.model) is CNN:
        return cnn_batched_log_probs
    names, model = trainer.names, trainer.model
    return vmap(lambda p, x: functional_call(model, dict(zip(names, p, strict=True)), (x,)))


def _scores(lp: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample NLL and correctness from log-probabilities ``[D, N, C]`` and labels ``[D, N]``."""
    return -lp.gather(2, y.unsqueeze(2)).squeeze(2), lp.argmax(2) == y


@torch.no_grad()
def evaluate_models(trainer: LocalTrainer, models: Sequence[Params], xs: Sequence[torch.Tensor],
                    ys: Sequence[torch.Tensor], device: torch.device,
                    max_elements: int = 2**23) -> list[tuple[float, int, int]]:
    """Each model on its own test set, many at once: per model the summed NLL, the number correct
    and the number of samples, as ``LocalTrainer.evaluate`` gives them. One model for all (a
    server's model sent to every device): one pass over the concatenated test sets, summed per
    device. Distinct models: devices sorted by test size and stacked in chunks (``_chunks``), each
    padded to its longest set, the padding masked."""
    log_probs = batched_log_probs(trainer)
    sizes = [len(y) for y in ys]
    row = max((x[0].numel() for x in xs if len(x)), default=1)
    if all(m is models[0] or all(torch.equal(a, b) for a, b in zip(m, models[0], strict=True)) for m in models[1:]):
        x, y = concatenated(xs, device), concatenated(ys, device)
        owner = torch.repeat_interleave(torch.arange(len(models), device=device), torch.tensor(sizes, device=device))
        loss = torch.zeros(len(models), dtype=torch.float64, device=device)
        correct = torch.zeros(len(models), dtype=torch.int64, device=device)
        model = stack([models[0]], device)
        step = max(1, max_elements // row)
        for a in range(0, len(y), step):
            nll, hit = _scores(log_probs(model, x[a:a + step].unsqueeze(0)), y[a:a + step].unsqueeze(0))
            loss.index_add_(0, owner[a:a + step], nll[0].double())
            correct.index_add_(0, owner[a:a + step], hit[0].long())
        return list(zip(loss.tolist(), correct.tolist(), sizes, strict=True))
    if sum(sizes) == 0:
        return [(0.0, 0, 0)] * len(models)
    out: dict[int, tuple[float, int, int]] = {}
    # Each chunk's padded sets are gathered from the concatenated ones (kept across messages,
    # hfl.accel.batched.kept) with one index a chunk, not copied set by set.
    x_all, y_all = concatenated(xs, device), concatenated(ys, device)
    starts = np.cumsum([0, *sizes[:-1]])
    for chunk in _chunks(sizes, row, max_elements, split=device.type == "cpu"):
        longest = max(sizes[chunk[-1]], 1)
        real = np.arange(longest) < np.array([sizes[m] for m in chunk])[:, None]  # [chunk, longest]
        rows = torch.from_numpy(np.where(real, starts[chunk][:, None] + np.arange(longest), 0).reshape(-1)).to(device)
        x = x_all.index_select(0, rows).view(len(chunk), longest, *x_all.shape[1:])
        y = y_all.index_select(0, rows).view(len(chunk), longest)
        mask = torch.from_numpy(real).to(device)
        nll, hit = _scores(log_probs(stack([models[m] for m in chunk], device), x), y)
        loss = torch.where(mask, nll, torch.zeros_like(nll)).sum(1).cpu().tolist()
        correct = (hit & mask).sum(1).cpu().tolist()
        for i, m in enumerate(chunk):
            out[m] = (float(loss[i]), int(correct[i]), sizes[m])
    return [out[m] for m in range(len(models))]


def _chunks(sizes: Sequence[int], row: int, max_elements: int, split: bool) -> list[list[int]]:
    """Positions of the test sets to stack together, each chunk sorted by size (its last set the
    longest, which the others are padded to): split where the padding costs more than a chunk
    (``size_buckets``; one 6,000-row Synthetic set padded its 9 team mates' few hundred rows to
    it; on the CPU: ``split``, a GPU pays for launches, not rows), and within ``max_elements``
    padded inputs."""
    chunks = []
    for group in size_buckets(sizes) if split else [sorted(range(len(sizes)), key=lambda m: sizes[m])]:
        start = 0
        while start < len(group):
            end = start + 1
            while end < len(group) and (end - start + 1) * max(sizes[group[end]], 1) * row <= max_elements:
                end += 1
            chunks.append(group[start:end])
            start = end
    return chunks


class BatchedEvaluate:
    """What a lowest node calls instead of ``hfl.node.inprocess.evaluate_children``: every device whose
    client evaluates the plain way (``model_to_test`` on its test split; ``clients``) is tested in
    one batched computation, any other child as usual. Same replies, same bytes counted."""

    def __init__(self, clients: dict[str, DeviceClientLike], proxies: dict[str, ClientProxy],
                 device: torch.device) -> None:
        self.clients, self.proxies, self.device = clients, proxies, device

    def __call__(self, manager: SimpleClientManager, parameters: Parameters,
                 config: dict) -> tuple[list[tuple[str, EvaluateRes]], int]:
        children = sorted(manager.all().values(), key=lambda p: p.cid)
        decoded = decode(parameters)
        replies: dict[str, EvaluateRes] = {}
        batch: list[tuple[str, DeviceRuntime, Params]] = []
        sent: Params | None = None  # the sent model as tensors, once for every device that tests it as it is
        for proxy in children:
            client = self.clients.get(proxy.cid) if self.proxies.get(proxy.cid) is proxy else None
            if client is None:
                replies[proxy.cid] = evaluate_child(proxy, parameters, config)
                continue
            if client.tests_sent_model(config):
                sent = to_tensors(decoded) if sent is None else sent
                model = sent
            else:
                model = client.model_to_test(decoded, dict(config))
            batch.append((proxy.cid, client.device, model))
        if batch:
            trainer = batch[0][1].trainer
            scores = evaluate_models(trainer, [m for _, _, m in batch], [d.x_test for _, d, _ in batch],
                                     [d.y_test for _, d, _ in batch], self.device)
            for (cid, dev, _), (loss_sum, correct, n) in zip(batch, scores, strict=True):
                replies[cid] = EvaluateRes(Status(Code.OK, "Success"), loss_sum / n, n,
                                           {"device_id": dev.device_id, "correct": correct})
        return [(p.cid, replies[p.cid]) for p in children], len(children) * payload_nbytes(parameters)
