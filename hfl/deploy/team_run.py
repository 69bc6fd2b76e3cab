"""The team tier of a deployment: a run on a team SuperLink over the team's device SuperNodes.

``TeamFitRun`` wraps the algorithm's own team strategy (the one simulation uses) for K
rounds; ``TeamEvaluationRun`` tests the global, team and personal models in one message
per device. Both write their result for the bridge (``hfl.deploy.jobs``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path

from flwr.common import (
    EvaluateIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from hfl.deploy.jobs import TeamJob, load_arrays, save_arrays, write_json
from hfl.node.evaluation import DeviceScore, target_report
from hfl.node.payload import decode, payload_nbytes

log = logging.getLogger("hfl")


class DeviceMissing(RuntimeError):
    """A device of the team whose update did not arrive (absent, failed, foreign or duplicate)."""


def wait_for_devices(client_manager: ClientManager, job: TeamJob) -> list[ClientProxy]:
    """The connected device nodes, after waiting up to ``device_wait_seconds`` for all of them."""
    client_manager.wait_for(job.num_devices, timeout=math.ceil(job.device_wait_seconds))
    nodes = sorted(client_manager.all().values(), key=lambda p: p.cid)
    if len(nodes) < job.num_devices:
        log.warning("team %d: %d of %d devices connected after %.0f s; going on without the others",
                    job.team_id, len(nodes), job.num_devices, job.device_wait_seconds)
    return nodes


def usable_replies(
    results: list[tuple[ClientProxy, FitRes]], job: TeamJob
) -> tuple[list[tuple[ClientProxy, FitRes]], int]:
    """Replies from distinct devices of this team, and how many of the team's devices have
    none. A device that reconnected may answer twice (old and new node) and a misconfigured
    device may belong to another team: neither may weigh in the mean."""
    seen: set[int] = set()
    kept = []
    for proxy, res in results:
        device_id = int(res.metrics.get("device_id", -1))
        if job.device_ids is not None and device_id not in job.device_ids:
            log.warning("team %d: ignored node %s: device %d is not in this team", job.team_id, proxy.cid, device_id)
            continue
        if device_id in seen:
            log.warning("team %d: ignored a second reply of device %d (node %s)", job.team_id, device_id, proxy.cid)
            continue
        seen.add(device_id)
        kept.append((proxy, res))
    return kept, max(0, job.num_devices - len(kept))


class TeamFitRun(Strategy):
    """K team rounds of ``inner`` over the device SuperNodes. Devices that are absent or do
    not answer within the round timeout count as failures against ``min_fit_fraction`` of
    the *expected* devices; a round that aggregates nothing stops the run."""

    def __init__(self, inner: Strategy, job: TeamJob, rounds: int) -> None:
        self.inner = inner
        self.job = job
        self.rounds = rounds
        self.report: dict = {"rounds": [], "bytes_down_team": 0, "bytes_up_team": 0, "num_examples": 0}
        self.start = time.perf_counter()

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return self.inner.initialize_parameters(client_manager)

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        wait_for_devices(client_manager, self.job)
        instructions = self.inner.configure_fit(server_round, parameters, client_manager)
        self.report["bytes_down_team"] += sum(payload_nbytes(ins.parameters) for _, ins in instructions)
        return instructions

    def aggregate_fit(self, server_round: int, results, failures):
        for failure in failures:
            log.warning("team %d round %d: device failure: %s", self.job.team_id, server_round, failure)
        kept, missing = usable_replies(results, self.job)
        self.report["bytes_up_team"] += sum(payload_nbytes(res.parameters) for _, res in results)
        parameters, stats = self.inner.aggregate_fit(
            server_round, kept, [DeviceMissing(f"device missing in round {server_round}")] * missing
        )
        self.report["rounds"].append({**stats, "missing": missing})
        if parameters is None:
            raise RuntimeError(
                f"team {self.job.team_id} round {server_round}: aggregated nothing "
                f"({len(kept)} usable replies, {missing} of {self.job.num_devices} devices missing)"
            )
        self.report["num_examples"] = sum(res.num_examples for _, res in kept)
        if server_round == self.rounds:
            self._write(parameters)
        return parameters, stats

    def _write(self, parameters: Parameters) -> None:
        save_arrays(self.job.model_path, decode(parameters))
        self.report["seconds"] = time.perf_counter() - self.start
        write_json(self.job.result, self.report)

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def evaluation_targets(global_model: bool, personalized: bool, has_team_model: bool) -> list[str]:
    return [t for t, on in (("gm", global_model), ("team", has_team_model), ("pm", personalized)) if on]


class TeamEvaluationRun(Strategy):
    """One round, no training: each device tests every target model in a single message
    (parameters = GM arrays followed by team-model arrays; config ``split`` marks the cut)."""

    def __init__(self, job: TeamJob, global_model: bool, personalized: bool) -> None:
        self.job = job
        self.gm = load_arrays(job.parent)
        self.team = load_arrays(job.team_model) if job.team_model else []
        self.targets = evaluation_targets(global_model, personalized, bool(self.team))
        self.start = time.perf_counter()

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.gm)

    def configure_fit(self, server_round, parameters, client_manager):
        return []

    def aggregate_fit(self, server_round, results, failures):
        return None, {}

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        nodes = wait_for_devices(client_manager, self.job)
        packed = ndarrays_to_parameters([*self.gm, *self.team])
        config: dict[str, Scalar] = {"targets": ",".join(self.targets), "split": len(self.gm)}
        self.bytes_down = payload_nbytes(packed) * len(nodes)
        return [(node, EvaluateIns(packed, config)) for node in nodes]

    def aggregate_evaluate(self, server_round, results, failures):
        metrics, answered = evaluation_counts(self.targets, [res for _, res in results], self.job.device_ids)
        missing = max(0, self.job.num_devices - answered)
        if answered == 0:
            raise RuntimeError(f"team {self.job.team_id}: no device answered the evaluation ({len(failures)} failures)")
        write_json(self.job.result, {"metrics": metrics, "missing": missing, "bytes_down_team": self.bytes_down,
                                     "seconds": time.perf_counter() - self.start})
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def evaluation_counts(targets: list[str], replies: list, device_ids: list[int] | None) -> tuple[dict, int]:
    """Pool device replies (``{t}_correct``, ``{t}_loss`` per target) into the team report
    the global strategy expects, and the number of devices pooled; replies of foreign
    devices or repeated ones are skipped."""
    answered: dict[int, Mapping[str, Scalar]] = {}
    for res in replies:
        device_id = int(res.metrics.get("device_id", -1))
        if (device_ids is None or device_id in device_ids) and device_id not in answered:
            answered[device_id] = {**res.metrics, "n": res.num_examples}
    ordered = [answered[d] for d in sorted(answered)]
    metrics: dict = {}
    for target in targets:
        rows = [DeviceScore(int(m["device_id"]), int(m[f"{target}_correct"]), int(m["n"]), float(m[f"{target}_loss"]))
                for m in ordered]
        metrics.update(target_report(target, rows))
    return metrics, len(answered)


def team_job_result(job: TeamJob) -> dict:
    """Raise unless the team run wrote its result (it does so only after its last round)."""
    path = Path(job.result)
    if not path.exists():
        raise RuntimeError(f"team {job.team_id}: the team run wrote no result ({path})")
    result = json.loads(path.read_text())
    if job.action == "fit" and not all(r.get("aggregated", 0) >= 1 for r in result.get("rounds", [])):
        raise RuntimeError(f"team {job.team_id}: a team round aggregated no device: {result.get('rounds')}")
    return result

