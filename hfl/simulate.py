"""``hfl-simulate``: run a hierarchical FL experiment configured with Hydra."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import hydra
from flwr.server import Server
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from hfl.apps import CONF_DIR, build_global_strategy, make_client_app, make_server_app
from hfl.config import validate
from hfl.errors import ConfigError, DatasetNotFoundError
from hfl.inprocess import InProcessClientProxy, client_manager_of
from hfl.node import build_team_node, check_tree, federation_for, initial_model

log = logging.getLogger("hfl")


def run_inprocess(cfg: Mapping, run_dir: Path) -> None:
    """Flower's legacy server loop over team nodes in this process (no Ray): the same
    strategies and clients, used for tests and to measure the runtime's overhead."""
    import torch

    torch.set_num_threads(int(cfg["runtime"]["torch_threads"]))
    teams = len(federation_for(cfg).teams)
    proxies = [
        InProcessClientProxy(f"{t:06d}", lambda t=t: build_team_node(cfg, t, cfg["runtime"]["state_dir"]).to_client())
        for t in range(teams)
    ]
    server = Server(client_manager=client_manager_of(proxies), strategy=build_global_strategy(cfg, run_dir))
    server.set_max_workers(1)
    server.fit(num_rounds=int(cfg["global_rounds"]), timeout=None)


def run_simulation(cfg: Mapping, run_dir: Path) -> None:
    """Flower's Simulation Runtime (Ray): one SuperNode per team."""
    from flwr.simulation import run_simulation as flwr_run_simulation

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    runtime = cfg["runtime"]
    init_args: dict = {"include_dashboard": False}
    if runtime.get("ray_tmp_dir"):
        init_args["_temp_dir"] = str(runtime["ray_tmp_dir"])
    flwr_run_simulation(
        server_app=make_server_app(cfg, run_dir),
        client_app=make_client_app(cfg),
        num_supernodes=len(federation_for(cfg).teams),
        backend_config={"client_resources": {"num_cpus": runtime["num_cpus_per_team"], "num_gpus": 0.0},
                        "init_args": init_args},
        verbose_logging=bool(runtime.get("verbose", False)),
    )


def run(cfg: Mapping, run_dir: str | Path) -> dict:
    """Validate, build the federation (failing before training on bad input), run, and
    return the summary; raises if the run did not complete every round."""
    cfg = json.loads(json.dumps(cfg))  # a private, plain copy
    run_dir = Path(run_dir)
    validate(cfg)
    if cfg["runtime"]["name"] == "deployment":
        raise ConfigError("runtime.name", "deployment runs are submitted to a running global SuperLink "
                          "with `hfl-deploy submit` (see README, Deployment), not started by hfl-simulate")
    fed = federation_for(cfg)
    check_tree(cfg, fed.tree)
    initial_model(cfg, fed)  # the model must fit the data before any process starts
    cfg["runtime"]["state_dir"] = str(run_dir / "state")
    log.info("hfl: %s on %s/%s, a tree of depth %d with %d level-1 nodes and %d devices -> %s", cfg["algorithm"]["name"],
             cfg["dataset"]["name"], cfg["model"]["name"], fed.tree.depth, len(fed.teams), len(fed.devices), run_dir)
    (run_dir / "state").mkdir(parents=True, exist_ok=True)
    (run_inprocess if cfg["runtime"]["name"] == "inprocess" else run_simulation)(cfg, run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if summary.get("rounds") != cfg["global_rounds"]:
        raise RuntimeError(
            f"the run stopped after {summary.get('rounds', 0)} of {cfg['global_rounds']} global rounds; "
            "see the log above for the Flower error"
        )
    return summary


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    # Hydra's root handlers already print and file Flower's records; drop Flower's own
    # console handler so that each line appears once.
    flwr_logger = logging.getLogger("flwr")
    for handler in list(flwr_logger.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            flwr_logger.removeHandler(handler)
    try:
        summary = run(OmegaConf.to_container(cfg, resolve=True), HydraConfig.get().runtime.output_dir)
    except (ConfigError, DatasetNotFoundError) as exc:
        # Bad input is the user's to fix: the message, not a traceback (exit status 1).
        log.error("%s", exc)
        raise SystemExit(f"hfl-simulate: {exc}") from None
    log.info("hfl: final PM %s GM %s, best PM %s GM %s, %.2f s/round",
             summary["final"]["pm_accuracy"], summary["final"]["gm_accuracy"],
             summary["best"]["pm_accuracy"], summary["best"]["gm_accuracy"], summary["seconds_per_round"] or 0)
    return summary["best"]["pm_accuracy"] or summary["best"]["gm_accuracy"]


if __name__ == "__main__":
    main()
