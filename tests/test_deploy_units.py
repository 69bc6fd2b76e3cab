"""The deployment pieces without processes: job files, the team run's bookkeeping, the
device wrapper, role command lines, certificates."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from hfl.config.checks import load_module
from hfl.deploy import roles
from hfl.deploy.certs import make_node_key, make_tls
from hfl.deploy.device import (
    DeployedDevice,
    device_client,
    export_device_data,
    load_device_data,
)
from hfl.deploy.jobs import TeamJob, load_arrays, save_arrays
from hfl.deploy.team_run import (
    TeamFitRun,
    evaluation_counts,
    team_job_result,
    usable_replies,
)
from hfl.deploy.wiring import check_role
from hfl.errors import ConfigError
from hfl.models import build_model
from hfl.runtime.build import device_runtime, federation_for, initial_model
from hfl.runtime.simulate import run
from hfl.state.store import StateStore
from hfl.device.training import LocalTrainer
from strategies.permfl import PerMFLServer
from tests.conftest import node_strategy


def job(tmp_path, **kw) -> TeamJob:
    base = {"action": "fit", "team_id": 0, "global_round": 1, "parent": str(tmp_path / "p.npz"),
            "result": str(tmp_path / "result.json"), "device_ids": [3, 5], "num_devices": 2,
            "device_wait_seconds": 1.0}
    return TeamJob(**{**base, **kw})


def reply(device_id: int, arrays, n: int = 10) -> tuple:
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, {"device_id": device_id})
    return SimpleNamespace(cid=f"node{device_id}"), res


def test_job_round_trip_and_bad_jobs(tmp_path) -> None:
    j = job(tmp_path)
    j.save(tmp_path / "job.json")
    assert TeamJob.load(tmp_path / "job.json") == j
    with pytest.raises(ValueError, match="action"):
        job(tmp_path, action="train")
    with pytest.raises(ValueError, match="2 device ids for 3 devices"):
        job(tmp_path, num_devices=3)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="unreadable"):
        TeamJob.load(tmp_path / "bad.json")


def test_usable_replies_drop_foreign_and_repeated_devices(tmp_path) -> None:
    a = [np.zeros(2, dtype=np.float32)]
    kept, missing = usable_replies([reply(3, a), reply(9, a), reply(3, a)], job(tmp_path))
    assert [r.metrics["device_id"] for _, r in kept] == [3]
    assert missing == 1  # device 5 never answered; 9 is not in the team; 3's second reply does not count


def test_fit_run_counts_missing_devices_against_min_fraction(tmp_path) -> None:
    alg = {"alpha": 0.1, "local_steps": 1, "eta": 0.5, "lam": 1.0, "gamma": 1.0, "weighted": False}
    parent = [np.ones(2, dtype=np.float32)]
    # min_fit_fraction 1: one of two devices missing stops the run, loudly
    full = TeamFitRun(node_strategy(PerMFLServer, parent, {**alg, "min_fit_fraction": 1.0}), job(tmp_path), rounds=1)
    full.inner.current = parent
    with pytest.raises(RuntimeError, match="1 of 2 devices missing"):
        full.aggregate_fit(1, [reply(3, [np.full(2, 3.0, dtype=np.float32)])], [])
    # min_fit_fraction 0.5: the round goes on with the device that answered, result written
    half = TeamFitRun(node_strategy(PerMFLServer, parent, {**alg, "min_fit_fraction": 0.5}), job(tmp_path), rounds=1)
    half.inner.current = parent
    params, _ = half.aggregate_fit(1, [reply(3, [np.full(2, 3.0, dtype=np.float32)])], [])
    # team_update: (1 - .5 - .5) w + .5 x + .5 theta_bar = .5 * 1 + .5 * 3 = 2
    np.testing.assert_allclose(load_arrays(half.job.model_path)[0], 2.0)
    result = team_job_result(half.job)
    assert result["rounds"] == [{"rejected": 0, "failures": 1, "aggregated": 1, "missing": 1}]
    assert result["num_examples"] == 10
    assert params is not None


def test_team_job_result_requires_the_file_and_an_aggregating_round(tmp_path) -> None:
    j = job(tmp_path)
    with pytest.raises(RuntimeError, match="wrote no result"):
        team_job_result(j)
    (tmp_path / "result.json").write_text(json.dumps({"rounds": [{"aggregated": 0}]}))
    with pytest.raises(RuntimeError, match="aggregated no device"):
        team_job_result(j)


def test_evaluation_counts_pool_per_target() -> None:
    def res(d: int, n: int, **m: float) -> SimpleNamespace:
        return SimpleNamespace(num_examples=n, metrics={"device_id": d, **m})

    replies = [res(5, 4, gm_correct=1, gm_loss=2.0), res(3, 6, gm_correct=3, gm_loss=1.0),
               res(7, 9, gm_correct=9, gm_loss=0.0), res(3, 6, gm_correct=0, gm_loss=9.0)]
    metrics, answered = evaluation_counts(["gm"], replies, [3, 5])
    assert answered == 2  # device 7 is foreign, 3's second reply ignored
    assert metrics["gm_correct"] == 4 and metrics["gm_n"] == 10
    assert metrics["gm_loss_sum"] == pytest.approx(2.0 * 4 + 1.0 * 6)
    assert json.loads(metrics["gm_devices"]) == [[3, 3, 6], [5, 1, 4]]


@pytest.fixture
def device(small_cfg, tmp_path):
    cfg = small_cfg()
    fed = federation_for(cfg)
    trainer = LocalTrainer(build_model(cfg["model"], fed.input_shape, fed.num_classes))
    store = StateStore(tmp_path / "state")
    client = load_module(cfg["algorithm"], "client").make_client(device_runtime(cfg, 0, fed.devices[0], trainer, store))
    return cfg, fed, DeployedDevice(client, store), store


def test_device_saves_state_and_answers_all_targets_in_one_reply(device) -> None:
    cfg, fed, node, store = device
    gm = initial_model(cfg, fed)
    config = {"alpha": 0.05, "local_steps": 3, "prox_coefficient": 0.5}
    team, _, _ = node.fit(gm, config)
    saved = store.load("device-0")
    assert saved is not None and int(saved["num_personal"]) == len(gm)
    loss, n, metrics = node.evaluate([*gm, *team], {"targets": "gm,team,pm", "split": len(gm)})
    for target, arrays, model in (("gm", gm, "global"), ("team", team, "team"), ("pm", [], "personal")):
        alone_loss, alone_n, alone = node.inner.evaluate(arrays, {"model": model})
        assert metrics[f"{target}_loss"] == pytest.approx(alone_loss)
        assert metrics[f"{target}_correct"] == alone["correct"] and alone_n == n
    assert loss == pytest.approx(metrics["gm_loss"])
    with pytest.raises(ValueError, match="unknown evaluation target"):
        node.evaluate(gm, {"targets": "gm,best", "split": len(gm)})


def test_device_data_file_round_trip_and_errors(small_cfg, tmp_path) -> None:
    cfg = small_cfg()
    export_device_data(cfg, 2, tmp_path / "d.npz")
    data, num_classes = load_device_data(tmp_path / "d.npz", 2)
    fed = federation_for(cfg)
    assert num_classes == fed.num_classes
    assert np.array_equal(data.x_train.numpy(), fed.devices[2].x_train.numpy())
    np.savez(tmp_path / "bad.npz", x_train=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="lacks num_classes, x_test, y_test, y_train"):
        load_device_data(tmp_path / "bad.npz", 0)


def test_roles_must_match_their_superlink() -> None:
    check_role("global", "team")
    check_role("global", None)  # simulation's team nodes
    check_role("team", "device")
    with pytest.raises(ValueError, match="connected to the global SuperLink"):
        check_role("global", "device")
    with pytest.raises(ValueError, match="connected to a team SuperLink"):
        check_role("team", "team")


def test_role_commands(tmp_path) -> None:
    paths = make_tls(tmp_path, ["edge-1"])
    tls = roles.ServerTls.from_dir(tmp_path)
    link, bridge = roles.team_role(1, "cloud:9092", "/w", tls=tls, global_ca="/g/ca.crt", num_devices=4)
    assert link[:1] == ["flower-superlink"] and "--insecure" not in link
    assert link[link.index("--ssl-certfile") + 1] == str(paths["cert"])
    assert bridge[bridge.index("--superlink") + 1] == "cloud:9092"
    assert bridge[bridge.index("--root-certificates") + 1] == "/g/ca.crt"
    assert bridge[bridge.index("--node-config") + 1] == (
        f'role="team" team-id=1 team-superlink="127.0.0.1:9192" team-root-certificates="{paths["ca"]}" '
        'work-dir="/w" num-devices=4'
    )
    (device,) = roles.device_role(7, "edge-1:9192", node_port=9300, state_dir="/s")
    assert "--insecure" in device and device[device.index("--port") + 1] == "9300"
    assert device[device.index("--node-config") + 1] == 'role="device" device-id=7 state-dir="/s"'
    with pytest.raises(FileNotFoundError, match="hfl-deploy certs"):
        roles.ServerTls.from_dir(tmp_path / "nothing")


def test_certificates_and_node_keys(tmp_path) -> None:
    paths = make_tls(tmp_path, ["superlink-global", "10.0.0.5"])
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"superlink-global", "localhost"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"10.0.0.5", "127.0.0.1"}
    private, public = make_node_key(tmp_path / "keys", "device-3")
    key = load_ssh_private_key(private.read_bytes(), password=None)
    assert key.curve.name == "secp384r1" and public.read_text().startswith("ecdsa-sha2-nistp384 ")


def test_hfl_simulate_refuses_the_deployment_runtime(small_cfg, tmp_path) -> None:
    with pytest.raises(ConfigError, match="hfl-deploy submit"):
        run(small_cfg("runtime=deployment"), tmp_path)


def test_arrays_files_round_trip(tmp_path) -> None:
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, dtype=np.float64)]
    save_arrays(tmp_path / "m.npz", arrays)
    back = load_arrays(tmp_path / "m.npz")
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(arrays, back, strict=True))


def test_device_from_a_data_file_equals_its_partition(small_cfg, tmp_path) -> None:
    cfg = small_cfg()
    export_device_data(cfg, 4, tmp_path / "d4.npz")
    by_file = device_client(cfg, {"device-id": 4, "data-path": str(tmp_path / "d4.npz"), "state-dir": str(tmp_path)}, "r1")
    by_id = device_client(cfg, {"device-id": 4, "state-dir": str(tmp_path)}, "r2")
    a, b = by_file.inner.device, by_id.inner.device
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert by_file.store.root == tmp_path / "r1"  # state lives per global run under state-dir
    with pytest.raises(ValueError, match="device-id 99 does not exist"):
        device_client(cfg, {"device-id": 99, "state-dir": str(tmp_path)}, "r3")
    with pytest.raises(ValueError, match="needs device-id"):
        device_client(cfg, {"state-dir": str(tmp_path)}, "r3")
