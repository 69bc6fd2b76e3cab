"""Build the tree's nodes (devices, their clients, inner nodes and their strategies) from the
configuration."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from flwr.common import NDArrays
from flwr.server.client_manager import SimpleClientManager

from hfl.clock.checks import check_clock
from hfl.clock.model import read_trace, run_clock
from hfl.clock.shift import run_shift
from hfl.clock.policy import LevelPolicy
from hfl.clock.realtime import Flights
from hfl.device.client import DeviceClient
from hfl.accel.batched import BatchedFit, batching_pays, resolve_device
from hfl.accel.batched_eval import BatchedEvaluate
from hfl.algorithm import NodeContext, RunSettings, ServerRule
from hfl.config.typed import algorithm_params
from hfl.config.checks import batched_setting, check_model_buffers, client_class, load_module, load_server
from hfl.data import DeviceData, Federation, build_federation
from hfl.data.labels import device_classes, device_data, model_classes
from hfl.device.state import DEVICES_PREFIX, DeviceRuntime, has_state, pack_states, unpack_states
from hfl.errors import ConfigError
from hfl.node.cohort import Selection
from hfl.node.faults import dropout_fractions
from hfl.node.secagg import SecAggSettings, check_secure_aggregation, secagg_fit_many
from hfl.runtime.children import DeviceCids, DeviceHolds, SubtreeHolds
from hfl.node.inprocess import (
    ChildProxies,
    EvaluateMany,
    FitMany,
    InProcessClientProxy,
    LazyClientManager,
    client_manager_of,
    evaluate_children,
    fit_one_by_one,
)
from hfl.models import build_model
from hfl.rules.payload import Payload
from hfl.seed import derive_seed
from hfl.state.store import StateStore
from hfl.tree.shape import Tree, child_path, level_of
from hfl.node.client import EvaluateTargets, NodeClient, NodeSpec
from hfl.device.training import BatchSampler, LocalTrainer, to_ndarrays


@lru_cache(maxsize=2)
def _federation(key: str) -> Federation:
    spec = json.loads(key)
    return build_federation(spec["dataset"], spec["topology"], spec["seed"])


def federation_for(cfg: Mapping) -> Federation:
    """The (process-wide cached) federation the configuration describes."""
    key = json.dumps({"dataset": cfg["dataset"], "topology": cfg["topology"], "seed": cfg["seed"]}, sort_keys=True)
    return _federation(key)


def initial_model(cfg: Mapping, fed: Federation) -> NDArrays:
    """The global model x^0, initialised from the run's seed."""
    torch.manual_seed(derive_seed(cfg["seed"], "init"))
    trainer = LocalTrainer(build_model(cfg["model"], fed.input_shape, model_classes(cfg["algorithm"]["local_labels"], fed, load_server(cfg["algorithm"]).personal_heads)))
    check_model_buffers(cfg, trainer.has_buffers)  # the algorithm must carry its BatchNorm statistics
    return to_ndarrays(trainer.initial_params())


def devices_key(path: str) -> str:
    """The stored key of a lowest node's devices' state (one file for all of them)."""
    return f"{DEVICES_PREFIX}{path}"


def device_runtime(cfg: Mapping, device_id: int, data: DeviceData, trainer: LocalTrainer, store: StateStore | None,
                   classes: list[int] | None = None) -> DeviceRuntime:
    """A device with its data, its seeded minibatch sampler and its saved state (if any; a node
    passes no store and restores its devices from its one packed file, NodeDevices)."""
    sampler = BatchSampler(len(data.y_train), int(cfg["dataset"]["batch_size"]), derive_seed(cfg["seed"], "batches", device_id))
    device = DeviceRuntime(device_id, data.x_train, data.y_train, data.x_test, data.y_test, trainer, sampler,
                           seed=int(cfg["seed"]), classes=classes, x_val=data.x_val, y_val=data.y_val)
    if store is not None:
        device.load(store)
    return device


class NodeDevices(Mapping[str, DeviceClient]):
    """A lowest node's device clients by cid (``"000042"``), each built when it is first asked
    for — its data, sampler, the state its node stored and its client — and kept until the
    node's message is done (a node lives for one message: hfl.node.inprocess, Flower's client_fn).
    A round that samples k of a node's n devices builds those k; evaluation builds them all.
    ``in`` never builds one; ``values()``/``items()`` build every device (evaluation only)."""

    def __init__(self, device_ids: list[int], build: Callable[[int], DeviceRuntime],
                 make_client: Callable[[DeviceRuntime], DeviceClient], store: StateStore, key: str) -> None:
        self.cids = DeviceCids(device_ids)
        self._build, self._make_client = build, make_client
        self._store, self._key = store, key
        self._clients: dict[str, DeviceClient] = {}
        self._stored: dict[int, dict[str, np.ndarray]] | None = None

    def __getitem__(self, cid: str) -> DeviceClient:
        client = self._clients.get(cid)
        if client is None:
            device = self._build(self.cids.device(cid))  # KeyError: no device of this node
            state = self.stored().get(device.device_id)
            if state is not None:
                device.restore(state)
            client = self._clients[cid] = self._make_client(device)
        return client

    def __contains__(self, cid: object) -> bool:
        return cid in self.cids

    def __iter__(self) -> Iterator[str]:
        return iter(self.cids)

    def __len__(self) -> int:
        return len(self.cids)

    def built(self) -> list[DeviceRuntime]:
        """The devices built so far (this message's)."""
        return [c.device for c in self._clients.values()]

    def stored(self) -> dict[int, dict[str, np.ndarray]]:
        """The node's stored device states by device id (read once per message)."""
        if self._stored is None:
            packed = self._store.load(self._key)
            self._stored = {} if packed is None else unpack_states(packed)
        return self._stored

    def save(self) -> None:
        """Every device state of the node in its one file: those built now as they are, the others
        as stored; a device never used is left out (hfl.device.state.has_state)."""
        states = dict(self.stored())
        for device in self.built():
            if has_state(device):
                states[device.device_id] = device.state()
            else:
                states.pop(device.device_id, None)
        self._store.save(self._key, pack_states(states))


class PlainClients(Mapping[str, DeviceClient]):
    """The clients of ``clients`` that test the plain way (``model_to_test`` on their test split,
    hfl.accel.batched_eval.BatchedEvaluate), each looked up, and so built, only when asked for."""

    def __init__(self, clients: Mapping[str, DeviceClient]) -> None:
        self.clients = clients

    def __getitem__(self, cid: str) -> DeviceClient:
        client = self.clients[cid]
        if type(client).evaluate is not DeviceClient.evaluate:
            raise KeyError(cid)  # tested by its own evaluate
        return client

    def __iter__(self) -> Iterator[str]:
        return iter(self.clients)

    def __len__(self) -> int:
        return len(self.clients)


def uses_batched(cfg: Mapping, trainer: LocalTrainer) -> bool:
    """Whether lowest nodes step their devices together: runtime.batched on, or auto where the
    algorithm's device client has the batched path (``DeviceClient.batched``), the model carries no buffers and the
    batched path is the faster one (hfl.accel.batched.batching_pays)."""
    setting = batched_setting(cfg["runtime"])
    if setting == "off" or not client_class(cfg["algorithm"]).batched:
        return False
    if any(True for _ in trainer.model.buffers()):
        if setting == "on":
            raise ConfigError("runtime.batched", f"{type(trainer.model).__name__} keeps buffers (BatchNorm), which the "
                                                 "batched path does not step; use runtime.batched=auto or off")
        return False
    return setting == "on" or batching_pays(trainer.model, resolve_device(cfg["runtime"]["device"]))


# ---------------------------------------------------------------- per-level settings
def level_selection(cfg: Mapping, level: int, lowest: bool) -> Selection:
    """How the nodes at ``level`` pick their rounds' children: ``algorithm.sample_fraction`` of the
    level (and its ``candidates``), and the simulated faults (hfl.node.faults) of the lowest servers' devices
    (``runtime.dropout``) or of the others' child nodes (``runtime.dropout_nodes``)."""
    devices, nodes = dropout_fractions(cfg["runtime"])
    params = algorithm_params(cfg["algorithm"])
    return Selection(params.fraction_at(level), devices if lowest else nodes, int(cfg["seed"]), params.candidates_at(level))


def partial_participation(cfg: Mapping, depth: int) -> bool:
    """Whether a device may not have trained when it is tested: some level samples its children (a
    device under a node never asked, too), the root draws devices, simulated faults, a clock."""
    params = algorithm_params(cfg["algorithm"])
    devices, nodes = dropout_fractions(cfg["runtime"])
    return (params.sampling == "devices" or devices > 0 or nodes > 0 or run_clock(cfg) is not None
            or any(params.fraction_at(level) < 1 for level in range(depth)))


def eval_fraction(cfg: Mapping, level: int, depth: int) -> float:
    """The fraction of its children a node at ``level`` asks to evaluate (top-level ``eval_fraction``):
    a list gives every level's, root first; one number is the lowest servers' (the fraction of the
    devices tested, whatever the depth), every node above asking all its children."""
    fraction = cfg["eval_fraction"]
    if isinstance(fraction, list | tuple):
        return float(fraction[level])
    return float(fraction) if level == depth - 1 else 1.0


def evaluation_sampled(cfg: Mapping) -> bool:
    """Whether some level evaluates a sample of its children."""
    fraction = cfg["eval_fraction"]
    return any(float(f) < 1 for f in (fraction if isinstance(fraction, list | tuple) else [fraction]))


def check_tree(cfg: Mapping, tree: Tree) -> None:
    """Refuse a tree the algorithm is not defined on, and per-level lists of the wrong length."""
    alg = cfg["algorithm"]
    if tree.depth != 2 and not load_server(alg).any_depth:
        key = "topology.fanout" if cfg["topology"]["formation"] == "tree" else "topology.formation"
        raise ConfigError(key, f"algorithm {alg['name']!r} is defined for three tiers (a tree of depth 2: root, "
                               f"servers, devices); this tree has depth {tree.depth}")
    for key, length in (("level_rounds", tree.depth - 1), ("sample_fraction", tree.depth), ("candidates", tree.depth)):
        value = alg.get(key)
        if isinstance(value, list | tuple) and len(value) != length:
            raise ConfigError(f"algorithm.{key}", f"has {len(value)} entries; this tree of depth {tree.depth} "
                                                  f"needs {length} ({'levels 1..' if key == 'level_rounds' else 'levels 0..'}"
                                                  f"{tree.depth - 1})")
    fraction = cfg["eval_fraction"]
    if isinstance(fraction, list | tuple) and len(fraction) != tree.depth:
        raise ConfigError("eval_fraction", f"has {len(fraction)} entries; this tree of depth {tree.depth} needs "
                                           f"{tree.depth} (levels 0..{tree.depth - 1})")
    load_server(alg).check_federation(cfg, federation_for(cfg))  # e.g. proxy sizes, a validation split
    check_clock(cfg, tree.depth, load_server(alg), federation_for(cfg))  # simulated time (hfl.clock)
    check_trace(cfg, tree)
    if alg["local_labels"] and float(cfg["dataset"]["proxy_fraction"]) > 0:
        raise ConfigError("algorithm.local_labels", "servers' proxy data keeps the dataset's labels; local labels "
                                                    "and dataset.proxy_fraction > 0 do not mix")
    model_classes(alg["local_labels"], federation_for(cfg), load_server(alg).personal_heads)  # refuses local labels without a common K
    check_candidates(cfg, tree.depth)
    check_secure_aggregation(cfg, tree)


def check_candidates(cfg: Mapping, depth: int) -> None:
    """``algorithm.candidates`` per level (power-of-choice, hfl.node.cohort): where set, at least the
    level's sample_fraction, which must be below 1; not under a clock (which picks the idle children)."""
    params = algorithm_params(cfg["algorithm"])
    for level in range(depth):
        candidates, fraction = params.candidates_at(level), params.fraction_at(level)
        if not candidates:
            continue
        key = "algorithm.candidates" + (f"[{level}]" if isinstance(params.candidates, list | tuple) else "")
        if fraction >= 1:
            raise ConfigError(key, f"level {level} asks every child (algorithm.sample_fraction is 1 there): "
                                   "candidates to choose from have no effect; give it a sample_fraction below 1, "
                                   "or 0 candidates")
        if candidates < fraction:
            raise ConfigError(key, f"{candidates:g} at level {level} is below its algorithm.sample_fraction "
                                   f"({fraction:g}): the children a round asks are chosen among the candidates")
        if cfg["clock"]["enabled"]:
            raise ConfigError(key, "a loss-aware choice of children and the simulated clock (clock.enabled, "
                                   "which asks the idle children) do not mix")


def check_trace(cfg: Mapping, tree: Tree) -> None:
    """``clock.trace``'s rows name devices of this federation: a row for a device that does not
    exist (a trace made for another federation) would be ignored, every device keeping its drawn speed."""
    clock = cfg["clock"]
    if not clock["enabled"] or not clock["trace"]:
        return
    devices = set(tree.devices_under(""))
    foreign = sorted(set(read_trace(clock["trace"])) - devices)
    if foreign:
        raise ConfigError("clock.trace", f"{clock['trace']} names device {foreign[0]}"
                                         f"{f' (and {len(foreign) - 1} more)' if len(foreign) > 1 else ''}, which this "
                                         f"federation lacks: its devices are {min(devices)}..{max(devices)}")


def build_node(cfg: Mapping, path: str, state_dir: str | Path) -> NodeClient:
    """The inner node at ``path`` with its whole subtree in this process."""
    fed = federation_for(cfg)
    tree = fed.tree
    alg = cfg["algorithm"]
    store = StateStore(state_dir)
    fit_many, evaluate_many = fit_one_by_one, evaluate_children
    if tree.is_lowest(path):
        client_module = load_module(alg, "client")
        trainer = LocalTrainer(build_model(cfg["model"], fed.input_shape, model_classes(cfg["algorithm"]["local_labels"], fed, load_server(cfg["algorithm"]).personal_heads)))
        local = bool(alg["local_labels"])

        shift, now = run_shift(cfg), [0.0]  # the simulated time the node's message is at (hfl.clock.shift)

        def build_device(d: int) -> DeviceRuntime:
            data = device_data(cfg, fed, d)
            if shift is not None:
                data = shift.apply(data, now[0])
            return device_runtime(cfg, d, data, trainer, None, device_classes(fed, d) if local else None)

        def at_time(t: float) -> None:
            now[0] = t

        # Devices exist only while they work: each is built when its node asks it (hfl.runtime.build.NodeDevices).
        clients = NodeDevices(tree.devices(path), build_device, client_module.make_client, store, devices_key(path))
        holds: Mapping[str, frozenset] = DeviceHolds(clients.cids)
        # A proxy per device made only when a round or an evaluation reads it (a sample reads few).
        by_cid = ChildProxies(clients.cids, lambda cid: InProcessClientProxy(cid, lambda: clients[cid].to_client()))
        proxies: list | SimpleClientManager = LazyClientManager(by_cid)
        if uses_batched(cfg, trainer):
            device = resolve_device(cfg["runtime"]["device"])
            fit_many = BatchedFit(clients, by_cid, device)
            # Clients that test the plain way (model_to_test on their test split) are tested together.
            evaluate_many = BatchedEvaluate(PlainClients(clients), by_cid, device)

        secagg = SecAggSettings.of(cfg)
        if secagg is not None:  # SecAgg+'s quantized weighted mean, without its masks (hfl.node.secagg)
            fit_many = secagg_fit_many(fit_many, secagg, int(cfg["seed"]), path)

        def persist() -> None:
            clients.save()
    else:
        proxies = [InProcessClientProxy(child, lambda child=child: build_node(cfg, child, state_dir).to_client())
                   for child in tree.children(path)]
        holds = SubtreeHolds(tree, tree.children(path))

        def persist() -> None:
            pass

        at_time = None
    return node_client(cfg, path, store, proxies, holds, persist, fit_many, evaluate_many, at_time=at_time)


def node_client(cfg: Mapping, path: str, store: StateStore, proxies: list | SimpleClientManager,
                holds: Mapping[str, frozenset[int]],
                persist: Callable[[], None] = lambda: None, fit_many: FitMany = fit_one_by_one,
                evaluate_many: EvaluateMany = evaluate_children,
                evaluate_targets: EvaluateTargets | None = None,
                at_time: Callable[[float], None] | None = None, flights: Flights | None = None) -> NodeClient:
    """The engine's node at ``path`` over ``proxies`` (its children: in this process, or remote
    ones in a deployment, hfl.deploy.node_server; or a manager of them, e.g. a LazyClientManager),
    ``holds`` naming the devices under each. ``flights``: a deployed node's calls to its children,
    through which, under ``clock.enabled``, its level's policy runs on real arrivals."""
    fed = federation_for(cfg)
    tree = fed.tree
    alg = cfg["algorithm"]
    level = level_of(path)
    server = load_server(alg)
    params, run = algorithm_params(alg), RunSettings.of(cfg)  # typed once per node (hfl.config.typed)

    def make_rule(payload: Payload, state: dict | None, round_path: str) -> ServerRule:
        return server(NodeContext(params, run, path, tree.depth, payload, state, fed, round_path=round_path))

    flights = flights if cfg["clock"]["enabled"] else None
    clock = run_clock(cfg) if flights is None else None  # a deployment's clock is the wall clock
    spec = NodeSpec(path, params.rounds_at(level, tree.depth), level_selection(cfg, level, tree.is_lowest(path)),
                    int(cfg["seed"]), tree.is_lowest(path), device_sampling=params.sampling == "devices",
                    partial=partial_participation(cfg, tree.depth),
                    eval_fraction=eval_fraction(cfg, level, tree.depth),
                    clock=clock, policy=LevelPolicy.for_level(cfg["clock"], level),
                    min_fit_fraction=params.min_fit_fraction)
    children = proxies if isinstance(proxies, SimpleClientManager) else client_manager_of(proxies)
    # What the algorithm is: its rule's class (hfl.algorithm)
    return NodeClient(spec, children, make_rule, store, server.nature(params, tree.depth, tree.is_lowest(path)),
                      persist=persist, holds=holds, fit_many=fit_many, evaluate_many=evaluate_many,
                      evaluate_targets=evaluate_targets, at_time=at_time, flights=flights,
                      steps_of=device_steps(cfg, fed) if clock is not None and tree.is_lowest(path) else None)


def device_steps(cfg: Mapping, fed: Federation) -> Callable[[int], int]:
    """A device's minibatch steps per call (its work in simulated time, hfl.clock):
    ``local_epochs`` epochs of its training data where the algorithm sets them, else ``local_steps``."""
    params = algorithm_params(cfg["algorithm"])
    epochs, steps, batch = params.local_epochs or 0, params.local_steps, int(cfg["dataset"]["batch_size"])
    if not epochs:
        return lambda device_id: steps
    return lambda device_id: epochs * -(-len(fed.devices[device_id].y_train) // batch)


def build_level1_node(cfg: Mapping, index: int, state_dir: str | Path) -> NodeClient:
    """The level-1 node ``index`` (a SuperNode of the simulation) with its subtree."""
    children = federation_for(cfg).tree.children("")
    if not 0 <= index < len(children):
        raise ValueError(f"level-1 node {index} does not exist: the topology has {len(children)} level-1 nodes")
    return build_node(cfg, child_path("", index), state_dir)
