"""Secure aggregation at the lowest servers (hfl.node.secagg, hfl.deploy.secagg): the quantized mean
against hand-computed values; Flower's own SecAgg+ workflow and mod, run over an in-memory grid,
against the simulation's mask-free sum bit for bit, a dropped device included; the in-process run
with secure aggregation against the plain one within the quantization's bound; refusals; and (slow)
a real deployment against the in-process run, with the lowest node server's files searched for any
device's reply."""

from __future__ import annotations

import copy
import itertools
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.client import ClientApp, NumPyClient
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)

from hfl.config.checks import validate
from hfl.errors import ConfigError
from hfl.node.secagg import (
    SecAggOverflow,
    SecAggSettings,
    check_fits,
    error_bound,
    quantized_mean,
)
from hfl.runtime.simulate import run
from tests.conftest import SMALL, compose_cfg
from tests.test_resume import global_model

S = SecAggSettings()


def fitres(arrays: list[np.ndarray], n: int) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, {"device_id": n})


class Named:
    def __init__(self, cid: str) -> None:
        self.cid = cid


# ---------------------------------------------------------------- the quantized mean by hand
def test_values_on_the_quantization_grid_give_the_exact_weighted_mean():
    # max_weight 1000: weights 250 -> 2**20 / 2**22 = 0.25 and 750 -> 0.75, exact in binary; the weighted
    # values 0.25 * 1.0 and 0.75 * -2.0 sit on the grid (2C/T = 2**-18), so no rounding is random.
    calls = [(Named("000000"), FitIns(ndarrays_to_parameters([np.zeros(2, np.float32)]), {"round_path": "1.1"})),
             (Named("000001"), FitIns(ndarrays_to_parameters([np.zeros(2, np.float32)]), {"round_path": "1.1"}))]
    outcomes = [fitres([np.float32([1.0, 0.5])], 250), fitres([np.float32([-2.0, 0.5])], 750)]
    out = quantized_mean(calls, outcomes, S, seed=0, path="0")
    # hand: (0.25 * 1 + 0.75 * -2) / 1 = -1.25; (0.25 * 0.5 + 0.75 * 0.5) = 0.5
    for res in out:
        got = parameters_to_ndarrays(res.parameters)[0]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.float32([-1.25, 0.5]))
    assert [r.num_examples for r in out] == [250, 750] and [r.metrics for r in out] == [{"device_id": 250},
                                                                                        {"device_id": 750}]


def test_random_values_stay_within_the_bound_and_the_rounding_is_seeded():
    g = np.random.default_rng(3)
    models = [[g.normal(0, 1, (50,)).astype(np.float32), g.normal(0, 1, (3, 4)).astype(np.float32)] for _ in range(4)]
    sizes = [30, 47, 12, 61]
    calls = [(Named(f"{i:06d}"), FitIns(ndarrays_to_parameters([np.zeros(50, np.float32), np.zeros((3, 4), np.float32)]),
                                        {"round_path": "2.1"})) for i in range(4)]
    out = quantized_mean(calls, [fitres(m, n) for m, n in zip(models, sizes, strict=True)], S, seed=1, path="0")
    got = parameters_to_ndarrays(out[0].parameters)
    exact = [sum(n * m[k].astype(np.float64) for m, n in zip(models, sizes, strict=True)) / sum(sizes) for k in range(2)]
    largest = max(float(np.abs(a).max()) for m in models for a in m)
    bound = error_bound(sizes, largest, S)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(got, exact, strict=True))
    assert 0 < diff <= bound, (diff, bound)
    again = quantized_mean(calls, [fitres(m, n) for m, n in zip(models, sizes, strict=True)], S, seed=1, path="0")
    assert all(np.array_equal(a, b) for a, b in zip(got, parameters_to_ndarrays(again[0].parameters), strict=True))


def test_a_value_the_quantization_would_clip_stops_the_round():
    with pytest.raises(SecAggOverflow, match="secagg_clipping_range"):
        check_fits([np.float32([300.0])], 30, S)  # 300 x 30 / 1000 = 9 > 8
    check_fits([np.float32([260.0])], 30, S)  # 7.8: within


def test_fewer_replies_than_the_threshold_fail_the_round():
    calls = [(Named(f"{i:06d}"), FitIns(ndarrays_to_parameters([np.zeros(1, np.float32)]), {})) for i in range(3)]
    out = quantized_mean(calls, [fitres([np.float32([1.0])], 10), RuntimeError("gone"), RuntimeError("gone")], S, 0, "0")
    assert all(isinstance(r, BaseException) for r in out)


# ---------------------------------------------------------------- Flower's workflow and mod, in memory
class Device(NumPyClient):
    def __init__(self, i: int, fail: bool = False) -> None:
        self.i, self.fail = i, fail

    def fit(self, parameters, config):
        if self.fail:
            raise RuntimeError("the device died")
        g = np.random.default_rng(self.i)  # its own data: deterministic, as a seeded device's training
        return [p + g.normal(0, 0.5, p.shape).astype(np.float32) for p in parameters], 20 + 7 * self.i, {"n": self.i}


class SecAggGrid:
    """Every pushed message answered at once by the device's ClientApp (hfl.app's mods around a
    NumPyClient), each device keeping its Context between messages as a SuperNode does."""

    def __init__(self, devices: dict[int, NumPyClient]) -> None:
        from hfl.app import _secagg_mod

        def app(device: NumPyClient) -> ClientApp:
            def client_fn(context: Context):
                return device.to_client()

            return ClientApp(client_fn=client_fn, mods=[_secagg_mod])

        self.apps = {n: app(d) for n, d in devices.items()}
        from flwr.app import Context, RecordDict

        self.contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
                         for n in devices}
        self.replies: dict[str, object] = {}
        self.ids = itertools.count()
        self.seen: list[object] = []  # every reply the node server received

    def push_messages(self, messages):
        from flwr.app import Error, Message

        out = []
        for msg in messages:
            msg_id = f"m{next(self.ids)}"
            msg.metadata.__dict__["_message_id"] = msg_id
            node = msg.metadata.dst_node_id
            try:  # a copy, as the SuperLink delivers one (the workflow sends one content to every device)
                reply = self.apps[node](message=copy.deepcopy(msg), context=self.contexts[node])
            except Exception as exc:  # noqa: BLE001 - as Flower's ClientApp runner reports it
                reply = Message(error=Error(code=2, reason=f"{type(exc)}:<'{exc}'>"), reply_to=msg)
            self.replies[msg_id] = reply
            out.append(msg_id)
        return out

    def pull_messages(self, message_ids):
        got = [self.replies.pop(i) for i in message_ids if i in self.replies]
        self.seen.extend(got)
        return got


@pytest.fixture
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    kept = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = kept


@pytest.mark.parametrize("dead", [None, 3], ids=["all", "one-dropped"])
def test_flowers_secagg_plus_equals_the_simulations_mask_free_sum_bit_for_bit(task_identity, dead):
    from hfl.deploy.grid import GridProxy
    from hfl.deploy.secagg import secagg_fit_together

    devices = {100 + i: Device(i, fail=i == dead) for i in range(5)}
    grid = SecAggGrid(devices)
    sent = [np.linspace(-1, 1, 30, dtype=np.float32).reshape(5, 6), np.float32([0.1, -0.2])]
    calls = [(GridProxy(f"{i:06d}", 100 + i, grid, timeout=30.0), FitIns(ndarrays_to_parameters(sent), {"round_path": "4.2"}))
             for i in range(5)]
    state = np.random.get_state()
    deployed = secagg_fit_together(S, 9, "1")(calls)
    assert np.array_equal(np.random.get_state()[1], state[1])  # the devices' seeding put NumPy's generator back
    local = [Device(i, fail=i == dead) for i in range(5)]
    outcomes: list = []
    for d in local:
        try:
            arrays, n, metrics = d.fit(sent, {})
            outcomes.append(FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics))
        except RuntimeError as exc:
            outcomes.append(exc)
    simulated = quantized_mean(calls, outcomes, S, 9, "1")
    for i, (a, b) in enumerate(zip(deployed, simulated, strict=True)):
        if i == dead:
            assert isinstance(a, BaseException) and isinstance(b, BaseException)
            continue
        assert a.num_examples == b.num_examples and a.metrics == b.metrics
        for x, y in zip(parameters_to_ndarrays(a.parameters), parameters_to_ndarrays(b.parameters), strict=True):
            assert x.dtype == y.dtype == np.float32
            np.testing.assert_array_equal(x, y)
    # What the node server received: no arrays, and masked vectors of integers modulo 2**32, never a model.
    from flwr.common import bytes_to_ndarray

    masked = 0
    for reply in grid.seen:
        if reply.has_error():
            continue
        assert all(len(record) == 0 for record in reply.content.array_records.values())
        for item in reply.content.config_records["secaggplus_configs"].get("masked_params", []):
            arr = bytes_to_ndarray(item)
            assert arr.dtype.kind == "i" and arr.min() >= 0 and arr.max() < S.modulus_range
            masked += 1
    assert masked == 3 * (5 - (dead is not None))  # the factor and the two arrays, per device that replied


def test_a_device_whose_values_would_be_clipped_stops_the_deployed_round(task_identity):
    from hfl.deploy.grid import GridProxy
    from hfl.deploy.secagg import secagg_fit_together

    grid = SecAggGrid({100 + i: Device(i) for i in range(3)})
    sent = [np.float32([500.0, 0.0])]  # x 0.02..0.034 weights: beyond 8 for every device
    calls = [(GridProxy(f"{i:06d}", 100 + i, grid, timeout=30.0), FitIns(ndarrays_to_parameters(sent), {}))
             for i in range(3)]
    with pytest.raises(SecAggOverflow, match="secagg_clipping_range"):
        secagg_fit_together(SecAggSettings(max_weight=1.0), 0, "0")(calls)


def test_train_messages_without_secagg_pass_the_mod_untouched():
    from flwr.app import Context, Message, RecordDict
    from flwr.compat.common import recorddict_compat as compat
    from flwr.supercore.task_identity import TaskIdentity

    from hfl.app import _secagg_mod

    kept = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    try:
        msg = Message(content=compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters([np.float32([1.0])]), {}), True),
                      dst_node_id=3, message_type="train")
        seen = []
        ctx = Context(run_id=1, node_id=3, node_config={}, state=RecordDict(), run_config={})
        _secagg_mod(msg, ctx, lambda m, c: seen.append(m) or "reply")
        assert seen == [msg] and not ctx.state.config_records
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = kept


# ---------------------------------------------------------------- in process: with against without
SECAGG = ["privacy.secure_aggregation=true"]
ONE_ROUND = ["algorithm=fedavg", "topology.num_teams=2", "topology.devices_per_team=3", "dataset.max_samples=300",
             "global_rounds=1", "algorithm.team_rounds=1", "algorithm.local_steps=5", "dataset.batch_size=32",
             "runtime=inprocess"]


def test_one_round_with_secure_aggregation_is_within_the_bound_of_the_plain_one(tmp_path, monkeypatch):
    from hfl.node import secagg

    seen: list[tuple[float, int]] = []  # per device reply: its largest value and its samples
    checked = secagg.check_fits

    def record(arrays, num_examples, s):
        seen.append((max(float(np.abs(a).max()) for a in arrays), num_examples))
        return checked(arrays, num_examples, s)

    monkeypatch.setattr(secagg, "check_fits", record)
    run(compose_cfg(*ONE_ROUND), tmp_path / "plain")
    run(compose_cfg(*ONE_ROUND, *SECAGG), tmp_path / "secagg")
    plain, secure = global_model(tmp_path / "plain"), global_model(tmp_path / "secagg")
    diff = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(plain, secure, strict=True))
    assert len(seen) == 6  # 2 teams x 3 devices, one round
    # The root's model is a weighted mean of the two teams' means: within the wider of their bounds.
    bound = max(error_bound([n for _, n in team], max(v for v, _ in team), S) for team in (seen[:3], seen[3:]))
    print(f"secagg vs plain, one round: max diff {diff:.3g}, bound {bound:.3g}")
    assert 0 < diff <= bound


def test_ray_equals_in_process_bit_for_bit_and_the_batched_path_is_summed_alike(tmp_path):
    common = [*SMALL, *SECAGG, "algorithm=fedavg", "global_rounds=2"]
    run(compose_cfg(*common, "runtime=inprocess", "runtime.batched=off"), tmp_path / "one-by-one")
    run(compose_cfg(*common, "runtime=simulation", "runtime.batched=off"), tmp_path / "ray")
    run(compose_cfg(*common, "runtime=inprocess", "runtime.batched=on"), tmp_path / "batched")
    run(compose_cfg(*SMALL, "algorithm=fedavg", "global_rounds=2", "runtime=inprocess"), tmp_path / "plain")
    one, ray, batched, plain = (global_model(tmp_path / name) for name in ("one-by-one", "ray", "batched", "plain"))
    for x, y, z in zip(one, ray, batched, strict=True):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_allclose(x, z, rtol=0, atol=1e-5)  # batched training sums in another order: float noise
    assert not all(np.array_equal(x, z) for x, z in zip(one, plain, strict=True))


def test_the_rule_s_weighted_mean_of_the_identical_replies_is_that_model_within_float_rounding():
    from hfl.rules.aggregate import mean_of

    g = np.random.default_rng(0)
    model = [g.normal(0, 1, (40,)).astype(np.float32), g.normal(0, 1, (3, 3)).astype(np.float32)]
    got = mean_of([model] * 5, [17, 31, 8, 50, 23])
    for a, b in zip(got, model, strict=True):
        np.testing.assert_allclose(a, b, rtol=4 * np.finfo(np.float32).eps, atol=0)


@pytest.mark.parametrize("overrides", [["algorithm=fedavg", "runtime.dropout=0.3", *SMALL[:4], "global_rounds=2",
                                        "algorithm.team_rounds=2", "algorithm.local_steps=5"],
                                       ["algorithm=bhfl", *SMALL[:4], "global_rounds=2", "algorithm.team_rounds=2",
                                        "algorithm.local_steps=5"]], ids=["fedavg-dropouts", "bhfl"])
def test_runs_with_dropped_devices_and_b_hfl_go_through(tmp_path, overrides):
    run(compose_cfg(*overrides, *SECAGG, "runtime=inprocess"), tmp_path / "run")
    assert (tmp_path / "run" / "checkpoints" / "global_model.npz").exists()


# ---------------------------------------------------------------- refusals, one line naming the key
@pytest.mark.parametrize(("overrides", "key"), [
    (["algorithm=femam", "algorithm.team_rounds=1"], "privacy.secure_aggregation"),
    (["algorithm=ifca"], "privacy.secure_aggregation"),
    (["algorithm=pflego", "algorithm.team_rounds=1"], "privacy.secure_aggregation"),
    (["algorithm=bhfl", "algorithm.residual_up_k=1"], "algorithm.residual_up_k"),
    (["algorithm.weighted=false"], "algorithm.weighted"),  # PerMFL's default: unweighted team means
    (["algorithm=fedavg", "privacy.level=lowest", "privacy.clip=1.0"], "privacy.level"),
    (["algorithm=fedavg", "clock.enabled=true", "clock.policy=deadline"], "clock.policy"),
    (["algorithm=fedavg", "privacy.secagg_num_shares=2"], "privacy.secagg_num_shares"),
    (["algorithm=fedavg", "privacy.secagg_num_shares=5", "privacy.secagg_reconstruction_threshold=5"],
     "privacy.secagg_reconstruction_threshold"),
    (["algorithm=fedavg", "privacy.secagg_modulus_range=3000000000"], "privacy.secagg_modulus_range"),
    (["algorithm=fedavg", "topology.devices_per_team=1"], "privacy.secure_aggregation"),
], ids=["femam", "ifca", "pflego", "bhfl-residual", "unweighted", "central-dp-lowest", "clock-deadline", "shares", "threshold", "modulus",
        "one-device"])
def test_refusals_name_the_key_in_one_line(overrides, key, tmp_path):
    with pytest.raises(ConfigError) as err:
        cfg = compose_cfg(*SMALL, *SECAGG, *overrides, "runtime=inprocess")
        validate(cfg)
        run(cfg, tmp_path / "run")
    assert err.value.key == key and "\n" not in str(err.value), str(err.value)


# ---------------------------------------------------------------- a real deployment
@pytest.mark.deployment
@pytest.mark.slow  # minutes: make test-deploy, or pytest -m deployment
@pytest.mark.parametrize("per_message", [False, True], ids=["runner", "per-message"])
def test_a_deployment_with_secure_aggregation_matches_in_process_and_its_node_servers_hold_no_device_reply(
        tmp_path: Path, per_message: bool) -> None:
    """2 node hosts x 2 devices, PerMFL (sample-weighted), 2 global rounds of 2 team rounds: each lowest node
    server runs Flower's SecAgg+ with its devices (their ClientApps' mod state carried between the four
    stage messages by the runner, or by Flower's process per message). The models are the in-process
    secure-aggregation run's within the quantization's bound (the rounding is seeded alike: in fact
    equal), and no file of a node server's work directory (state, mailbox, node.log) holds any device's
    reply, which each device keeps beside its state (the search finds it there)."""
    from hfl.deploy.device import REPLY
    from hfl.state.store import StateStore
    from tests.test_deployment import BASE, deployed, model, simulated

    overrides = [*BASE, "algorithm.weighted=true", "global_rounds=2", "eval_every=2", "algorithm.team_rounds=2", *SECAGG]
    start = time.monotonic()
    run_dir, dep = deployed(tmp_path, overrides, per_message=per_message)
    seconds = time.monotonic() - start
    sim_dir = simulated(tmp_path, overrides)
    deployed_model, sim_model = model(run_dir), model(sim_dir)
    diff = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(deployed_model, sim_model, strict=True))
    replies = {}  # each device's last reply, kept beside its state on its host: (samples, arrays)
    for d in dep.tree.devices_under(""):
        (folder,) = (dep.root / f"device{d}-state").glob("run-*")
        stored = StateStore(folder).load(f"device-{d}")
        replies[d] = (int(stored[f"{REPLY}n"]), [stored[f"{REPLY}{i}"] for i in range(int(stored[f"{REPLY}count"]))])
    # a round's bound at the node with the least weight, from the devices' last replies (their values and samples)
    largest = max(float(np.abs(a).max()) for _, arrays in replies.values() for a in arrays)
    bound = max(error_bound([replies[d][0] for d in dep.tree.devices(path)], largest, S)
                for path in dep.inner if dep.tree.is_lowest(path))
    assert diff <= bound, (diff, bound)
    checked = 0
    for d, (_, reply) in replies.items():
        (folder,) = (dep.root / f"device{d}-state").glob("run-*")
        needle = max(reply, key=lambda a: a.nbytes).tobytes()
        needle = needle[len(needle) // 2 - 64: len(needle) // 2 + 64]  # 128 bytes of its largest array
        assert len(needle) == 128 and any(needle in f.read_bytes() for f in folder.rglob("*") if f.is_file())
        for path in dep.inner:
            files = [f for f in (dep.root / f"node-{path}-work").rglob("*") if f.is_file()]
            assert files and not [f for f in files if needle in f.read_bytes()], (d, path)
            checked += len(files)
    costs = []
    for path in dep.inner:
        (log_file,) = (dep.root / f"node-{path}-work").rglob("node.log")
        text = log_file.read_text()
        assert "Traceback" not in text
        costs += [float(line.split(" s of it beside training")[0].rsplit(", ", 1)[1])
                  for line in text.splitlines() if "secure aggregation of 2 of 2 devices" in line]
    assert len(costs) == 2 * 2 * 2  # nodes x global rounds x team rounds
    print(f"secagg deployment ({'per-message' if per_message else 'runner'}): {seconds:.0f} s; models vs in-process "
          f"max diff {diff:.3g} (bound {bound:.3g}); {checked} node-server files searched; SecAgg+ beside training "
          f"{np.median(costs):.2f} s per round (median; {min(costs):.2f}..{max(costs):.2f})")
