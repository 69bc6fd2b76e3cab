"""FedAvg+ (algorithm=fedavg_ft): FedAvg's training, then each device fine-tunes the global
model before testing it (its PM). The fine-tuning is seeded by (run seed, device, round), leaves
the device's state alone, and improves its training loss; a run's GM is FedAvg's exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clients.fedavg_ft import FedAvgFtClient, finetune, global_round
from hydra.errors import ConfigCompositionException

from hfl.config import schema
from hfl.config.checks import validate
from strategies.fedavg_ft import FedAvgFTServer
from hfl.device.state import DeviceRuntime
from hfl.errors import ConfigError
from hfl.models import build_model
from hfl.seed import derive_seed
from hfl.runtime.simulate import run
from hfl.device.training import BatchSampler, LocalTrainer, to_ndarrays, to_tensors
from tests.conftest import compose_cfg

FIT = {"alpha": 0.05, "local_steps": 3, "fit_test": False, "finetune_epochs": 2, "finetune_lr": 0.5,
       "node_round": 1, "round_path": "3.1"}


def tiny_device(seed: int = 0) -> DeviceRuntime:
    """MCLR on 40 points of 5 features, 3 linearly separable classes; batches of 8."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 5, generator=g)
    y = (x @ torch.randn(5, 3, generator=g)).argmax(1)
    torch.manual_seed(seed)
    trainer = LocalTrainer(build_model({"name": "mclr"}, (5,), 3))
    return DeviceRuntime(7, x, y, x[:10], y[:10], trainer, BatchSampler(40, 8, seed=11), seed=123)


def trained_client() -> tuple[FedAvgFtClient, list[np.ndarray]]:
    """A device after one FedAvg round, and a global model to fine-tune (its initial model)."""
    dev = tiny_device()
    client = FedAvgFtClient(dev)
    gm = to_ndarrays(dev.trainer.initial_params())
    client.fit(gm, dict(FIT))
    return client, gm


def train_loss(dev: DeviceRuntime, params) -> float:
    loss_sum, _, n = dev.trainer.evaluate(params, dev.x_train, dev.y_train)
    return loss_sum / n


def sampler_state(dev: DeviceRuntime) -> dict[str, list]:
    return {k: np.asarray(v).tolist() for k, v in dev.sampler.state().items()}


def test_the_pm_is_the_global_model_fine_tuned_reproducibly_and_state_is_untouched():
    client, gm = trained_client()
    dev = client.device
    assert dev.personal is None  # FedAvg's device keeps no model of its own (its state is its sampler and extra)
    before = (sampler_state(dev), {k: np.copy(v) for k, v in dev.extra.items()})
    pm = client.model_to_test(gm, {"model": "personal"})
    again = client.model_to_test(gm, {"model": "personal"})
    assert all(torch.equal(a, b) for a, b in zip(pm, again, strict=True))  # reproducible
    assert sampler_state(dev) == before[0]  # the training sampler did not move
    assert dev.personal is None  # nor is a fine-tuned model kept
    assert dev.extra.keys() == before[1].keys() and all(np.array_equal(dev.extra[k], before[1][k]) for k in dev.extra)
    assert not all(torch.equal(a, b) for a, b in zip(pm, to_tensors(gm), strict=True))  # PM differs from GM
    assert train_loss(dev, pm) < train_loss(dev, to_tensors(gm))  # fine-tuning helps on its own data
    # evaluate(): the PM through the fine-tuning, the GM as sent
    pm_loss, n, metrics = client.evaluate(gm, {"model": "personal"})
    gm_loss, _, _ = client.evaluate(gm, {"model": "global"})
    assert n == 10 and metrics["device_id"] == 7 and pm_loss != gm_loss
    assert gm_loss == pytest.approx(dev.trainer.evaluate(to_tensors(gm), dev.x_test, dev.y_test)[0] / 10)
    assert sampler_state(dev) == before[0]


def test_the_batch_order_follows_seed_device_and_round():
    client, gm = trained_client()
    dev = client.device
    expected = finetune(dev.trainer, to_tensors(gm), dev.x_train, dev.y_train, batch_size=8, epochs=2, lr=0.5,
                        seed=derive_seed(123, "finetune", 7, 3))
    pm = client.model_to_test(gm, {"model": "personal"})
    assert all(torch.equal(a, b) for a, b in zip(pm, expected, strict=True))
    # another round (its last training message says round 4): another batch order, another PM
    client.fit(gm, {**FIT, "round_path": "4.1"})
    later = client.model_to_test(gm, {"model": "personal"})
    assert not all(torch.equal(a, b) for a, b in zip(pm, later, strict=True))
    assert global_round({"round_path": "12.3.1"}) == 12


def test_finetune_runs_whole_epochs_and_zero_epochs_is_the_global_model():
    dev = tiny_device()
    start = dev.trainer.initial_params()
    calls = []
    trainer = dev.trainer

    class Counting:
        names = trainer.names
        has_buffers = trainer.has_buffers

        def loss_and_grad(self, params, x, y):
            calls.append(len(y))
            return trainer.loss_and_grad(params, x, y)

    finetune(Counting(), start, dev.x_train, dev.y_train, batch_size=16, epochs=2, lr=0.1, seed=0)
    assert calls == [16, 16, 8, 16, 16, 8]  # two passes over 40 samples, the last batch of each short
    same = finetune(trainer, start, dev.x_train, dev.y_train, batch_size=16, epochs=0, lr=0.1, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(same, start, strict=True))


def test_a_device_that_never_trained_or_got_no_model_says_so():
    dev = tiny_device()
    gm = to_ndarrays(dev.trainer.initial_params())
    with pytest.raises(RuntimeError, match="has not trained yet"):
        FedAvgFtClient(dev).model_to_test(gm, {"model": "personal"})
    client, _ = trained_client()
    with pytest.raises(RuntimeError, match="sent none"):
        client.model_to_test([], {"model": "personal"})


# ---------------------------------------------------------------- config


def test_config_is_fedavgs_plus_the_fine_tuning_keys():
    ft, avg = compose_cfg("algorithm=fedavg_ft")["algorithm"], compose_cfg("algorithm=fedavg")["algorithm"]
    own = {"name", "strategy", "client", "finetune_epochs", "finetune_lr"}
    assert {k: v for k, v in ft.items() if k not in own} == {k: v for k, v in avg.items() if k not in own}
    assert set(avg) - set(ft) == set()
    assert (ft["finetune_epochs"], ft["finetune_lr"]) == (2, avg["alpha"])
    # what FedAvg+ is: its rule's class, not its config (hfl.algorithm.ServerRule)
    assert (FedAvgFTServer.personalized, FedAvgFTServer.pm_base, FedAvgFTServer.any_depth) == (True, "gm", True)
    # the learning rate defaults to the training one, and follows it
    assert compose_cfg("algorithm=fedavg_ft", "algorithm.alpha=0.07")["algorithm"]["finetune_lr"] == 0.07
    assert compose_cfg("algorithm=fedavg_ft", "algorithm.finetune_lr=0.3")["algorithm"]["finetune_lr"] == 0.3
    validate(compose_cfg("algorithm=fedavg_ft", "runtime=inprocess"))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algorithm.finetune_epochs=-1", "algorithm.finetune_epochs"),
        ("algorithm.finetune_lr=0", "algorithm.finetune_lr"),
        ("algorithm.sample_fraction=0.5", "algorithm.sample_fraction"),
    ],
)
def test_config_refusals_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose_cfg("algorithm=fedavg_ft", "runtime=inprocess", override))


@pytest.mark.parametrize("override", ["algorithm.pm_base=own", "algorithm.personalized=false"])
def test_what_fedavg_ft_is_is_no_setting(override):
    with pytest.raises(ConfigCompositionException) as caught:
        compose_cfg("algorithm=fedavg_ft", override)
    error = schema.config_error(caught.value)
    assert isinstance(error, ConfigError) and error.key == override.split("=")[0]
    assert "the algorithm's nature" in str(error)


# ---------------------------------------------------------------- a whole run


def lines_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


MODEL_KEYS = ("gm_", "team_", "level1_", "level2_")
VOLATILE = ("seconds", "compute_seconds")


@pytest.mark.parametrize("topology", [("algorithm.team_rounds=1",),
                                      ("algorithm.team_rounds=1", "topology=tree", "topology.fanout=[2,2,3]")],
                         ids=["flat", "depth3"])
def test_a_run_trains_fedavgs_models_and_reports_a_fine_tuned_pm(small_cfg, tmp_path, topology):
    common = ("runtime=inprocess", "global_rounds=2", *topology)
    run(small_cfg("algorithm=fedavg", *common), tmp_path / "fedavg")
    summary = run(small_cfg("algorithm=fedavg_ft", *common), tmp_path / "ft")
    avg, ft = lines_of(tmp_path / "fedavg"), lines_of(tmp_path / "ft")
    assert [line["round"] for line in ft] == [1, 2]
    for a, f in zip(avg, ft, strict=True):
        shared = {k: v for k, v in a.items() if k.startswith(MODEL_KEYS)}
        assert shared and "gm_accuracy" in shared
        # The same training, so the same GM and server models, exactly (in round 2 too: evaluating
        # the PMs in round 1 did not move the devices' training samplers).
        assert {k: f[k] for k in shared} == shared
        assert a["pm_accuracy"] is None and a["client_mean_accuracy"] is None
        assert 0 <= f["pm_accuracy"] <= 1 and 0 <= f["client_mean_accuracy"] <= 1
        assert f["client_mean_accuracy"] == f["pm_client_mean_accuracy"]
    with np.load(tmp_path / "fedavg" / "checkpoints" / "global_model.npz") as a, \
         np.load(tmp_path / "ft" / "checkpoints" / "global_model.npz") as f:
        assert all(np.array_equal(a[k], f[k]) for k in a.files)
    assert summary["final"]["client_mean_accuracy"] == ft[-1]["client_mean_accuracy"]
    # reproducible: the same seed gives the same PM
    run(small_cfg("algorithm=fedavg_ft", *common), tmp_path / "again")
    again = lines_of(tmp_path / "again")
    assert [line["pm_accuracy"] for line in again] == [line["pm_accuracy"] for line in ft]
    assert [line["pm_loss"] for line in again] == [line["pm_loss"] for line in ft]
