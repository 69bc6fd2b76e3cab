"""The team bridge: on an edge host, a SuperNode of the global SuperLink whose ClientApp
answers each global message by running a team run on the host's own team SuperLink.

Node config (``flower-supernode --node-config``):
  role="team"  team-id=N                  which team of the topology this host serves
  team-superlink="127.0.0.1:9192"         the local team SuperLink (its Control API)
  team-root-certificates="/tls/ca.crt"    its CA when it serves TLS ("" = insecure)
  work-dir="/var/lib/hfl/team-0"          job files, team models, the private FLWR_HOME
  app-dir="/opt/hfl"                       the app submitted to the team SuperLink
                                           (default: this package's project directory)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from flwr.client import NumPyClient
from flwr.common import NDArrays, Scalar

from hfl.deploy.control import ControlClient
from hfl.deploy.jobs import TeamJob, load_arrays, save_arrays
from hfl.deploy.team_run import team_job_result
from hfl.node.evaluation import evaluation_result

log = logging.getLogger("hfl")


@dataclass(frozen=True)
class BridgeSettings:
    team_id: int
    device_ids: list[int] | None  # None: any device, ``num_devices`` of them
    num_devices: int
    overrides: str
    state_key: str           # the global run: device and team state live under it
    work_dir: Path
    device_wait_seconds: float
    team_run_timeout: float
    global_model: bool


class TeamBridge(NumPyClient):
    def __init__(self, settings: BridgeSettings, link: ControlClient) -> None:
        self.s = settings
        self.link = link
        self.dir = settings.work_dir / settings.state_key
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def team_model_path(self) -> Path:
        return self.dir / f"team-{self.s.team_id}.npz"

    def _run(self, action: str, parent: NDArrays, global_round: int) -> tuple[TeamJob, dict, float]:
        job_dir = self.dir / f"round-{global_round:05d}-{action}"
        job_dir.mkdir(parents=True, exist_ok=True)
        save_arrays(job_dir / "parent.npz", parent)
        for stale in (job_dir / "result.json", job_dir / "result.npz"):
            stale.unlink(missing_ok=True)
        job = TeamJob(
            action=action, team_id=self.s.team_id, global_round=global_round, parent=str(job_dir / "parent.npz"),
            result=str(job_dir / "result.json"), device_ids=self.s.device_ids, num_devices=self.s.num_devices,
            device_wait_seconds=self.s.device_wait_seconds,
            team_model=str(self.team_model_path) if action == "evaluate" and self.team_model_path.exists() else None,
        )
        job.save(job_dir / "job.json")
        start = time.perf_counter()
        run_config = {"tier": "team", "job": str(job_dir / "job.json"), "overrides": self.s.overrides,
                      "state-key": self.s.state_key}
        run_id = self.link.submit(run_config, job_dir / "run-config.toml")
        log.info("team %d: %s for global round %d is team run %d", self.s.team_id, action, global_round, run_id)
        status = self.link.wait(run_id, self.s.team_run_timeout, done=Path(job.result).exists)
        if status != "finished:completed":
            raise RuntimeError(f"team {self.s.team_id}: team run {run_id} ({action}, global round {global_round}) "
                               f"ended {status}; see the team SuperLink's log")
        return job, team_job_result(job), time.perf_counter() - start

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        job, result, seconds = self._run("fit", parameters, int(config.get("global_round", 0)))
        model = load_arrays(job.model_path)
        save_arrays(self.team_model_path, model)
        metrics: dict[str, Scalar] = {
            "team_id": self.s.team_id,
            "compute_seconds": seconds,
            "team_run_seconds": seconds,
            "bytes_down_team": result["bytes_down_team"],
            "bytes_up_team": result["bytes_up_team"],
            "device_failures": sum(r["missing"] for r in result["rounds"]),
            "rejected": sum(r.get("rejected", 0) for r in result["rounds"]),
        }
        return model, int(result["num_examples"]), metrics

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        _, result, seconds = self._run("evaluate", parameters, int(config.get("global_round", 0)))
        metrics = {**result["metrics"], "team_id": self.s.team_id, "compute_seconds": seconds,
                   "bytes_down_team": result["bytes_down_team"], "device_failures": result["missing"]}
        return evaluation_result(metrics, self.s.global_model)
