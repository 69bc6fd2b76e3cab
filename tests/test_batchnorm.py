"""Models with BatchNorm (ResNet-9): the running statistics travel with the parameters, a
training step matches PyTorch's (train mode + SGD on the parameters), evaluation uses the
running statistics, FeMAM's frozen levels stay in eval mode, and short runs average them."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hfl.rules.steps import sgd_step
from clients.femam import FemamClient
from clients.permfl import device_step
from hfl.algorithm import model_from_state
from hfl.config.checks import check_model_buffers
from hfl.device.state import DeviceRuntime
from hfl.errors import ConfigError
from hfl.models import CNN, MCLR, build_model
from hfl.rules.payload import pack
from hfl.runtime.simulate import run
from hfl.state.store import StateStore
from hfl.device.training import BatchSampler, LocalTrainer, run_local_steps, to_ndarrays, to_tensors
from strategies import femam_rules as rules
from tests.conftest import compose_cfg

SHAPE = (3, 16, 16)


def resnet(seed: int = 0, classes: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return build_model({"name": "resnet9"}, SHAPE, classes)


def images(n: int, seed: int, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, *SHAPE, generator=g) + y.view(-1, 1, 1, 1) * 0.5  # shifted means: non-trivial statistics
    return x, y


def load(module: nn.Module, trainer: LocalTrainer, params: list[torch.Tensor]) -> nn.Module:
    """``module`` holding ``params`` (names from the trainer; counters left as they are)."""
    module.load_state_dict(dict(zip(trainer.names, params, strict=True)), strict=False)
    return module


def buffers_of(trainer: LocalTrainer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p, b in zip(params, trainer.buffer_mask, strict=True) if b]


# ---------------------------------------------------------------- the list of tensors
def test_the_list_is_the_state_dict_without_counters_and_the_mask_marks_the_buffers():
    model = resnet()
    trainer = LocalTrainer(model)
    params = dict(model.named_parameters())
    stats = {n: b for n, b in model.named_buffers() if not n.endswith("num_batches_tracked")}
    initial = trainer.initial_params()
    assert len(initial) == len(params) + len(stats) == 62 and len(stats) == 24
    assert trainer.names == [n for n in model.state_dict() if not n.endswith("num_batches_tracked")]
    assert [n for n, b in zip(trainer.names, trainer.buffer_mask, strict=True) if b] == list(stats)
    assert all(m == (n in stats) for n, m in zip(trainer.names, trainer.buffer_mask, strict=True))
    assert trainer.names[-2:] == ["head.weight", "head.bias"]  # the head stays last (FeMAM's features, head_mask)
    for name, value in zip(trainer.names, initial, strict=True):
        torch.testing.assert_close(value, (stats | params)[name].detach(), rtol=0, atol=0)
    # a model without buffers: its parameters, in order, as before
    for plain in (MCLR((6,), 3), CNN((1, 8, 8), 3)):
        t = LocalTrainer(plain)
        assert t.names == [n for n, _ in plain.named_parameters()] and not any(t.buffer_mask) and not t.has_buffers


# ---------------------------------------------------------------- one training step
def reference_steps(model: nn.Module, trainer: LocalTrainer, start, batches, lr: float, prox: float, anchor):
    """PyTorch's way: the module in train mode, SGD (+ prox pull) on its parameters only."""
    ref = load(copy.deepcopy(model).train(), trainer, start)
    named = dict(ref.named_parameters())
    anchors = {n: a for n, a, b in zip(trainer.names, anchor, trainer.buffer_mask, strict=True) if not b}
    for x, y in batches:
        ref.zero_grad()
        F.nll_loss(ref(x), y).backward()
        with torch.no_grad():
            for name, p in named.items():
                p -= lr * p.grad + lr * prox * (p - anchors[name])
    state = ref.state_dict()
    return [state[n] for n in trainer.names]


@pytest.mark.parametrize("prox", [0.0, 0.5])
def test_training_steps_equal_a_module_in_train_mode_with_sgd_on_its_parameters(prox):
    model = resnet(1)
    trainer = LocalTrainer(copy.deepcopy(model))
    x, y = images(24, seed=2)
    start = trainer.initial_params()
    lr, steps = 0.1, 3
    update = (lambda p, g: sgd_step(p, g, lr)) if prox == 0 else (lambda p, g: device_step(p, g, start, lr, prox))
    got, loss = run_local_steps(trainer, start, x, y, BatchSampler(24, 10, seed=5), steps, update)
    order = BatchSampler(24, 10, seed=5)  # the same minibatches (10, 10, then the short 4)
    batches = [(x[idx], y[idx]) for idx in (order.next() for _ in range(steps))]
    want = reference_steps(model, trainer, start, batches, lr, prox, start)
    for name, a, b in zip(trainer.names, got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    # the running statistics moved (momentum 0.1 toward the batches'), and the start is untouched
    assert all(not torch.equal(a, s) for a, s in zip(buffers_of(trainer, got), buffers_of(trainer, start)))
    torch.testing.assert_close(buffers_of(trainer, start)[1], torch.ones(8), rtol=0, atol=0)
    assert np.isfinite(loss)


def test_callers_stepping_models_themselves_are_refused_for_batchnorm():
    trainer = LocalTrainer(resnet())
    x, y = images(4, seed=0)
    with pytest.raises(ConfigError, match=r"model\.name"):
        trainer.loss_and_grad(trainer.initial_params(), x, y)


def test_batchnorm_with_a_cumulative_average_is_refused():
    model = resnet()
    model.body[1].momentum = None  # would read num_batches_tracked, which hfl does not carry
    with pytest.raises(ConfigError, match=r"model\.name"):
        LocalTrainer(model)


# ---------------------------------------------------------------- evaluation
def trained_resnet(model_seed: int, data_seed: int, n: int, sampler_seed: int, steps: int):
    """A ResNet-9, its trainer, n images, and its state after ``steps`` SGD steps on them."""
    model = resnet(model_seed)
    trainer = LocalTrainer(copy.deepcopy(model))
    x, y = images(n, seed=data_seed)
    trained, _ = run_local_steps(trainer, trainer.initial_params(), x, y, BatchSampler(n, 16, sampler_seed), steps,
                                 lambda p, g: sgd_step(p, g, 0.2))
    return model, trainer, x, y, trained


def test_evaluation_uses_the_running_statistics_and_changes_nothing():
    model, trainer, x, y, trained = trained_resnet(2, 3, 40, 0, 4)
    kept = [p.clone() for p in trained]
    loss_sum, correct, n = trainer.evaluate(trained, x, y, chunk=7)  # chunks: eval mode does not depend on them
    ref = load(copy.deepcopy(model), trainer, trained).eval()
    with torch.no_grad():
        out = ref(x)
        batch_stats = load(copy.deepcopy(model), trainer, trained).train()(x)
    assert loss_sum == pytest.approx(float(F.nll_loss(out, y, reduction="sum")), rel=1e-5)
    assert correct == int((out.argmax(1) == y).sum()) and n == 40
    assert abs(loss_sum - float(F.nll_loss(batch_stats, y, reduction="sum"))) > 1e-3  # train mode would differ
    assert all(torch.equal(a, b) for a, b in zip(trained, kept, strict=True))


# ---------------------------------------------------------------- FeMAM
def test_femam_frozen_resnet_level_runs_in_eval_mode_and_keeps_its_statistics():
    # a level-1 model with trained running statistics, frozen; level 2 starts from another model
    model, trainer, x, y, level1 = trained_resnet(3, 4, 46, 1, 3)
    start = LocalTrainer(resnet(4)).initial_params()
    dev = DeviceRuntime(0, x[:30], y[:30], x[30:38], y[30:38], trainer, BatchSampler(30, 30, 1),
                        x_val=x[38:], y_val=y[38:])
    arrays, meta = pack("parts", {"model": to_ndarrays(start), "freeze": to_ndarrays(level1)})
    config = {"alpha": 0.5, "local_steps": 2, "local_epochs": 0, "prox": 0.01, "num_levels": 3, "prune": "paper",
              "femam_kind": rules.CLUSTER, "femam_level": 2, "femam_first": 1, "femam_keep": 1, **meta}
    reply, _, metrics = FemamClient(dev).fit(arrays, config)
    # by hand: the frozen level in eval mode, the new one in train mode, SGD + prox on its parameters
    frozen = load(copy.deepcopy(model), trainer, level1).eval()
    new = load(copy.deepcopy(model), trainer, start).train()
    anchor = {n: p.detach().clone() for n, p in new.named_parameters()}
    with torch.no_grad():
        fixed = frozen(dev.x_train)
    for _ in range(2):  # one batch of all 30 samples per step
        new.zero_grad()
        loss = F.cross_entropy((fixed + new(dev.x_train)) / 2, dev.y_train)
        loss = loss + 0.01 * sum(((p - anchor[n]) ** 2).sum() for n, p in new.named_parameters())
        loss.backward()
        with torch.no_grad():
            for p in new.parameters():
                p -= 0.5 * p.grad
    want = new.state_dict()
    for name, got in zip(trainer.names, to_tensors(reply), strict=True):
        torch.testing.assert_close(got, want[name], rtol=0, atol=1e-6, msg=name)
    # the frozen level is kept as sent, its statistics unchanged by the forward passes over it
    stored = FemamClient(dev).frozen(0)
    assert all(torch.equal(a, b) for a, b in zip(stored, level1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers_of(trainer, to_tensors(to_ndarrays(level1))),
                                                 buffers_of(trainer, stored)))
    trained = buffers_of(trainer, to_tensors(reply))
    assert not all(torch.equal(a, b) for a, b in zip(trained, buffers_of(trainer, start)))  # the new level's moved
    assert metrics["val_n"] == 8


# ---------------------------------------------------------------- refusals before training
@pytest.mark.parametrize("algorithm", ["pfedme", "perfedavg", "pfedbayes", "pflego"])
def test_algorithms_that_cannot_carry_buffers_refuse_resnet9(algorithm):
    cfg = compose_cfg(f"algorithm={algorithm}", "model=resnet9", "dataset=cifar10")
    with pytest.raises(ConfigError, match=r"model\.name"):
        check_model_buffers(cfg, True)
    check_model_buffers(cfg, False)  # models without BatchNorm: nothing to refuse
    check_model_buffers(compose_cfg("algorithm=fedavg", "model=resnet9", "dataset=cifar10"), True)


def fake_cifar10(root: Path, n: int = 320) -> None:
    """A CIFAR-10 test batch of random images (offline): class-dependent colour plus noise."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, n)
    data = np.clip(rng.normal(100, 40, (n, 3, 32, 32)) + labels[:, None, None, None] * 10, 0, 255)
    (root / "cifar-10-batches-py").mkdir(parents=True)
    with (root / "cifar-10-batches-py" / "test_batch").open("wb") as f:
        pickle.dump({"data": data.astype(np.uint8).reshape(n, -1), "labels": labels.tolist()}, f)


def tiny_image_run(root: Path, *overrides: str) -> list[str]:
    return ["dataset=cifar10", f"dataset.root={root}", "dataset.partition=iid", "model=resnet9",
            "runtime=inprocess", "runtime.torch_threads=1", "dataset.batch_size=16", "seed=0", *overrides]


def global_model(run_dir: Path) -> list[np.ndarray]:
    return model_from_state(StateStore(run_dir / "state").load("node-root"))  # the root's, after the last round


def running_vars(model: list[np.ndarray]) -> list[np.ndarray]:
    trainer = LocalTrainer(build_model({"name": "resnet9"}, (3, 32, 32), 10))
    return [a for a, n in zip(model, trainer.names, strict=True) if n.endswith("running_var")]


def test_pflego_refuses_resnet9_before_training(tmp_path):
    fake_cifar10(tmp_path / "data")
    cfg = compose_cfg(*tiny_image_run(tmp_path / "data", "algorithm=pflego", "topology.num_teams=2",
                                      "topology.devices_per_team=2", "dataset.partition=roundrobin",
                                      "dataset.classes_per_device=3"))
    with pytest.raises(ConfigError, match=r"model\.name"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "state").exists()  # refused before any training


@pytest.mark.parametrize("algorithm", ["fedavg", "femam"])
def test_short_resnet9_runs_train_and_average_the_running_statistics(tmp_path, algorithm):
    fake_cifar10(tmp_path / "data")
    if algorithm == "fedavg":
        extra = ["algorithm=fedavg", "topology.num_teams=2", "topology.devices_per_team=2", "global_rounds=2",
                 "algorithm.local_steps=2", "algorithm.alpha=0.05"]
    else:
        extra = ["algorithm=femam", "topology=tree", "topology.fanout=[2,2]", "dataset.val_fraction=0.2",
                 "global_rounds=4", "algorithm.levels=[1,2,0]", "algorithm.rounds_per_level=[2,1,1]",
                 "algorithm.prune_window=1", "algorithm.local_epochs=1", "algorithm.alpha=0.05"]
    summary = run(compose_cfg(*tiny_image_run(tmp_path / "data", *extra)), tmp_path / "run")
    assert summary["rounds"] == (2 if algorithm == "fedavg" else 4)
    variances = running_vars(global_model(tmp_path / "run"))
    assert len(variances) == 12
    assert not all(np.array_equal(v, np.ones_like(v)) for v in variances)  # trained, averaged, sent back
    assert all(np.all(v > 0) for v in variances)


@pytest.mark.parametrize("algorithm", ["pfedme", "perfedavg"])
def test_run_refuses_resnet9_before_training_for_algorithms_without_buffers(tmp_path, algorithm):
    """The refusal reaches hfl.runtime.simulate.run before any round (not a round-1 'no level-1 model')."""
    fake_cifar10(tmp_path / "data")
    cfg = compose_cfg(*tiny_image_run(tmp_path / "data", f"algorithm={algorithm}"))
    with pytest.raises(ConfigError, match=r"model\.name"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "state").exists()  # refused before any training
