"""The Flower APIs hfl uses, against docs/architecture.md's table ("Flower APIs hfl uses, and
which Flower has deprecated"): every name hfl imports from Flower is classified here and named
in that section; the classification is checked against the installed Flower (where a name is
defined, whether Flower still warns about what the table calls deprecated), and hfl's uses of
the APIs the table calls not deprecated are made with Flower's log watched, so a Flower that
starts warning about one of them fails here rather than in a run's log. Imports Flower only
(not hfl, not torch): well under 2 s."""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("hfl", "clients", "strategies", "benchmarks")
FLOWER_PACKAGES = ("flwr", "flwr_datasets")
SECTION = "## Flower APIs hfl uses, and which Flower has deprecated"

# Every Flower name imported in SOURCES -> its kind in the table:
#   deprecated: Flower logs "DEPRECATED FEATURE" when hfl calls it
#   compat:     defined in flwr.compat ("Compatibility package containing deprecated legacy
#               components", flwr/compat/__init__.py), no warning
#   legacy:     flwr.server's round-loop family, outside flwr.compat, not marked deprecated
#   current:    the Message API and app names (flwr.app, flwr.serverapp, ClientApp, ServerApp)
#   private:    Flower internals hfl patches or reads, each guarded in hfl
API = {
    "flwr": "current",  # flwr.__version__ (hfl.deploy.supernode)
    "flwr.simulation.run_simulation": "deprecated",
    "flwr.server.ServerApp": "current",
    "flwr.server.ServerAppComponents": "compat",
    "flwr.client.ClientApp": "current",
    "flwr.client.Client": "compat",
    "flwr.client.NumPyClient": "compat",
    "flwr.server.Server": "legacy",
    "flwr.server.History": "legacy",
    "flwr.server.ServerConfig": "legacy",
    "flwr.server.server.run_fl": "legacy",
    "flwr.server.strategy.Strategy": "legacy",
    "flwr.server.strategy.FedAvg": "legacy",
    "flwr.server.client_proxy.ClientProxy": "legacy",
    "flwr.server.client_manager.ClientManager": "legacy",
    "flwr.server.client_manager.SimpleClientManager": "legacy",
    "flwr.common.FitIns": "compat",
    "flwr.common.FitRes": "compat",
    "flwr.common.EvaluateIns": "compat",
    "flwr.common.EvaluateRes": "compat",
    "flwr.common.GetPropertiesIns": "compat",
    "flwr.common.GetPropertiesRes": "compat",
    "flwr.common.GetParametersIns": "compat",
    "flwr.common.GetParametersRes": "compat",
    "flwr.common.ReconnectIns": "compat",
    "flwr.common.DisconnectRes": "compat",
    "flwr.common.Parameters": "compat",
    "flwr.common.Status": "compat",
    "flwr.common.Code": "compat",
    "flwr.common.NDArrays": "compat",
    "flwr.common.Scalar": "compat",
    "flwr.common.ndarrays_to_parameters": "compat",
    "flwr.common.parameters_to_ndarrays": "compat",
    "flwr.common.ndarray_to_bytes": "compat",
    "flwr.compat.common.recorddict_compat": "compat",
    "flwr.common.MessageTypeLegacy": "legacy",
    "flwr.common.logger.log": "current",
    "flwr.common.Context": "current",
    "flwr.common.constant.ErrorCode": "current",
    "flwr.app.Context": "current",
    "flwr.app.Message": "current",
    "flwr.app.RecordDict": "current",
    "flwr.app.message_type.MessageType": "current",
    "flwr.serverapp.grid.Grid": "current",
    "flwr.server.superlink.fleet.vce.vce_api": "private",
    "flwr.superlink.grid.inmemory_grid.InMemoryGrid": "private",
    "flwr.superlink.routers.fleet.router.router": "private",
    "flwr.supernode.start_client_internal": "private",
    "flwr.supernode.cli.flower_supernode": "private",
    # The task protocol a host's runner speaks to its SuperNode (hfl.deploy.runner), behind runner_supported
    "flwr.supercore.runtime.RuntimeHttpClient": "private",
    "flwr.supercore.interceptors.RuntimeVersionHttpInterceptor": "private",
    "flwr.supercore.interceptors.RuntimeTokenHttpInterceptor": "private",
    "flwr.proto.runtime_pb2.AcquireTaskRequest": "private",
    "flwr.proto.runtime_pb2.SendTaskHeartbeatRequest": "private",
    "flwr.supercore.constant.TaskType": "private",
    "flwr.supercore.heartbeat.HeartbeatSender": "private",
    "flwr.supercore.retry.retry_invoker.RetryInvoker": "private",
    "flwr.supercore.retry.retry_invoker.exponential": "private",
    "flwr.supernode.runtime.run_clientapp": "private",
    "flwr.supernode.runtime.run_clientapp.pull_task_input": "private",
    "flwr.supernode.runtime.run_clientapp.push_message": "private",
    "flwr.supernode.runtime.run_clientapp.push_task_output": "private",
    "flwr.cli.install.install_from_fab": "private",
    "flwr.clientapp.utils.get_load_client_app_fn": "private",
    "flwr.common.config.get_project_dir": "private",
    "flwr.clientapp.client_app.LoadClientAppError": "private",
    "flwr.app.error.Error": "current",
    "flwr.common.constant.SubStatus": "current",
    # Flower's split of adaptive clipping's noise (hfl.rules.privacy): where 1.42 defines it, and 1.41
    "flwr.supercore.differential_privacy.compute_adaptive_noise_params": "private",
    "flwr.common.differential_privacy.compute_adaptive_noise_params": "private",
    # Secure aggregation at the lowest servers (hfl.node.secagg, hfl.deploy.secagg): Flower's SecAgg+ workflow and
    # mod, and the quantization arithmetic simulation repeats (checked bit for bit against them in test_secagg)
    "flwr.server.workflow.SecAggPlusWorkflow": "legacy",
    "flwr.server.compat.legacy_context.LegacyContext": "legacy",
    "flwr.server.workflow.constant.MAIN_CONFIGS_RECORD": "legacy",
    "flwr.server.workflow.constant.MAIN_PARAMS_RECORD": "legacy",
    "flwr.server.workflow.constant.Key": "legacy",
    "flwr.client.mod.secaggplus_mod": "current",
    "flwr.app.ArrayRecord": "current",
    "flwr.app.ConfigRecord": "current",
    "flwr.common.secure_aggregation.secaggplus_constants.RECORD_KEY_CONFIGS": "private",
    "flwr.common.secure_aggregation.secaggplus_constants.RECORD_KEY_STATE": "private",
    "flwr.common.secure_aggregation.ndarrays_arithmetic.factor_combine": "private",
    "flwr.common.secure_aggregation.ndarrays_arithmetic.factor_extract": "private",
    "flwr.common.secure_aggregation.ndarrays_arithmetic.parameters_mod": "private",
    "flwr.common.secure_aggregation.quantization.quantize": "private",
    "flwr.common.secure_aggregation.quantization.dequantize": "private",
    "flwr_datasets.partitioner.IidPartitioner": "current",
    "flwr_datasets.partitioner.DirichletPartitioner": "current",
    "flwr_datasets.partitioner": "current",  # any of its partitioners, by name (hfl.data.huggingface)
}

# Where flwr.compat defines what hfl imports through flwr.common / flwr.client / flwr.server.
COMPAT_MODULES = ("flwr.compat.common.typing", "flwr.compat.common.parameter", "flwr.compat.client.client",
                  "flwr.compat.client.numpy_client", "flwr.compat.server.serverapp_components")


def flower_imports() -> dict[str, set[str]]:
    """``module.name`` (or ``module`` for a plain import) -> the files importing it."""
    found: dict[str, set[str]] = {}
    for source in SOURCES:
        for path in sorted((ROOT / source).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FLOWER_PACKAGES:
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.split(".")[0] in FLOWER_PACKAGES]
                else:
                    continue
                for name in names:
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert SECTION in text, f"docs/architecture.md lost its section {SECTION!r}"
    body = text.split(SECTION, 1)[1]
    return body.split("\n## ", 1)[0]


def resolve(name: str):  # noqa: ANN201 (any Flower object)
    try:
        return importlib.import_module(name)
    except ImportError:
        module, attr = name.rsplit(".", 1)
        return getattr(importlib.import_module(module), attr)


def test_every_flower_import_is_classified():
    used = flower_imports()
    missing = {name: sorted(files) for name, files in used.items() if name not in API}
    assert not missing, ("hfl imports Flower names the table in docs/architecture.md does not list; add them there "
                         f"and to tests/test_flower_api.py's API: {missing}")
    stale = sorted(set(API) - set(used))
    assert not stale, f"no longer imported by hfl: drop them from the table and from API: {stale}"


def test_the_table_names_every_api():
    text = section()
    spans = " ".join(re.findall(r"`([^`]*)`", text))
    absent = [name for name in API if not re.search(rf"\b{re.escape(name.rsplit('.', 1)[-1])}\b", spans)]
    assert not absent, f"docs/architecture.md's Flower table does not name: {absent}"


@pytest.mark.parametrize("name", sorted(n for n, kind in API.items() if kind in ("compat", "legacy", "current")
                                        and n.startswith("flwr.") and "recorddict_compat" not in n))
def test_where_flower_defines_it(name):
    """compat: defined in flwr.compat; legacy/current: defined outside it. A Flower that moves
    a name into (or out of) its compatibility package changes the table's row."""
    obj = resolve(name)
    short = name.rsplit(".", 1)[-1]
    home = getattr(obj, "__module__", None) or ""
    in_compat = home.startswith("flwr.compat") or any(
        getattr(importlib.import_module(m), short, None) is obj for m in COMPAT_MODULES)
    assert in_compat == (API[name] == "compat"), f"{name}: defined in {home or 'an alias'}; the table says {API[name]}"


def test_what_the_table_calls_deprecated_still_warns():
    from flwr.simulation import run_simulation

    assert "warn_deprecated_feature(" in inspect.getsource(run_simulation)


@contextmanager
def flower_quiet():
    """Fails if Flower logs a deprecation (its ``warn_deprecated_feature`` logs through the
    ``flwr`` logger, not ``warnings``) or Python warns ``DeprecationWarning`` within."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("flwr")
    handler = Keep(logging.DEBUG)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            yield
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records if "deprecat" in r.getMessage().lower()]
    assert not said, f"Flower now warns about an API the table calls not deprecated: {said}"


@pytest.fixture
def task_identity():
    """A ServerApp's identity, as Flower sets it in the process running one (Message needs it);
    the process's own put back after."""
    from flwr.supercore.task_identity import TaskIdentity

    kept = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = kept


def test_hfl_uses_of_what_is_not_deprecated_do_not_warn(task_identity):
    """hfl's own forms: ServerApp(server_fn=...) returning ServerAppComponents(server=...), a
    ServerApp subclass overriding ``__call__``, ClientApp(client_fn=...) with a Context
    parameter answering legacy messages through a NumPyClient's ``to_client()``, the Message
    constructor (not Grid.create_message), flwr.compat's record conversions, Server/run_fl's
    types."""
    from flwr.app import Context, Message, RecordDict
    from flwr.app.message_type import MessageType
    from flwr.client import Client, ClientApp, NumPyClient
    from flwr.common import (Code, FitIns, GetPropertiesIns, MessageTypeLegacy, Status, ndarray_to_bytes,
                             ndarrays_to_parameters, parameters_to_ndarrays)
    from flwr.common.logger import log
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import History, Server, ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.client_manager import SimpleClientManager

    class Node(NumPyClient):
        def get_properties(self, config):
            return {"path": "0"}

        def fit(self, parameters, config):
            return [p + 1 for p in parameters], 1, {}

    def client_fn(context: Context) -> Client:
        return Node().to_client()

    with flower_quiet():
        manager = SimpleClientManager()
        server = Server(client_manager=manager)
        ServerApp(server_fn=lambda context: ServerAppComponents(server=server, config=ServerConfig(num_rounds=1)))

        class Dispatching(ServerApp):
            def __call__(self, grid, context) -> None:
                pass

        Dispatching()
        History()
        log(logging.DEBUG, "[ROUND %s]", 1)
        app = ClientApp(client_fn=client_fn)
        context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
        weights = [np.arange(3, dtype=np.float32)]
        fit = Message(content=compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(weights), {}), keep_input=True),
                      dst_node_id=1, message_type=MessageType.TRAIN, ttl=10.0)
        reply = app(fit, context)
        res = compat.recorddict_to_fitres(reply.content, keep_input=False)
        assert res.status.code == Code.OK and parameters_to_ndarrays(res.parameters)[0].tolist() == [1.0, 2.0, 3.0]
        ask = Message(content=compat.getpropertiesins_to_recorddict(GetPropertiesIns({})), dst_node_id=1,
                      message_type=MessageTypeLegacy.GET_PROPERTIES, ttl=10.0)
        assert compat.recorddict_to_getpropertiesres(app(ask, context).content).properties == {"path": "0"}
        assert isinstance(Status(Code.OK, ""), Status) and ndarray_to_bytes(weights[0])
