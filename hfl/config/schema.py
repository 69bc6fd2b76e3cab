"""The config schema: Hydra structured configs (dataclasses in Hydra's ConfigStore) that
declare the type of every key of every config group, checked by Hydra while it composes.

Layout (Hydra's "Structured Config schema" pattern, the schema in its own config group):
every YAML file of ``conf/`` extends its schema from its defaults list, e.g.
``conf/algorithm/permfl.yaml`` starts with ``defaults: [/schema/algorithm/permfl@_here_, _self_]``,
and ``conf/config.yaml`` with ``/schema/config`` (the top-level keys; the groups are typed by
their options' files, so a new option whose file names no schema still composes, untyped, and
``tests/test_schema.py`` flags it). The schemas live in the ``schema/...`` groups
rather than beside the options they check, so ``algorithm=glob(*)`` sweeps and the group
listing of ``hfl-simulate --help`` stay the real options (the help lists ``schema/*`` as
groups of their own: they are not meant to be selected).

What is typed here: every key's type (``int``, ``float``, ``bool``, ``str``, ``Optional[...]``
for the nullable ones, ``List[int]``/``List[float]``/``List[List[int]]`` where a list has one
shape), so a wrong type is refused while Hydra composes, naming the key
(``algorithm.local_steps=abc``, ``global_rounds=1.5``, ``algorithm.prox_slip=maybe``);
``hfl-simulate`` prints it as one line (``config_error`` turns Hydra's error into a
``ConfigError``). Float keys accept integers (``algorithm.alpha=1`` is 1.0; so the runtime's
seconds and ``num_cpus_per_team``, floats, show as ``1.0`` where the YAML says ``1``).

Algorithms differ in their keys. ``AlgorithmConfig`` declares the keys every algorithm has
(``HierFAVGConfig``: the same, HierFAVG's); each algorithm with more keys has a dataclass
subclassing it beside its rule (``strategies/permfl.py``'s ``PerMFLConfig``, ``PerMFLServer.schema``;
``BHFLConfig``, ...), registered by ``algorithm_schemas`` under the name its YAML file's
defaults list gives, so its own keys are typed too and adding an algorithm touches no file of hfl. A schema is closed, as
Hydra's configs are, and stays closed to ``+key=value``/``++key=value`` (which Hydra lets through):
``check_keys`` refuses after composing a key nothing reads, naming the closest real key or the
option that has it; a preset that sets another algorithm's key (``experiment=permfl_mnist_mclr
algorithm=fedavg`` sets ``algorithm.eta``) is refused naming that key. Datasets likewise:
``DatasetConfig`` for the keys common to all, then ``VisionDatasetConfig``,
``SyntheticDatasetConfig`` and ``SyntheticMultilevelDatasetConfig``; models (``hidden`` for
the MLP/DNN/CNN), topologies (``fanout``/``nodes`` for ``tree``) and runtimes the same way.

Defaults are declared once, in the YAML files: schema fields are ``MISSING`` here, so a
value comes only from ``conf/`` (or an override), and a YAML file that forgets a key its
schema declares leaves it ``???``, which ``hfl.config.checks.validate`` refuses naming the key.
The exception: keys every option of a group has with one engine default that its files need not
repeat (``AlgorithmConfig``'s ``sampling``, ``sample_fraction``, ``candidates``, ``level_rounds``,
``local_labels``, ``local_epochs``; ``RuntimeConfig``'s ``state_dir``, ``team_wait_seconds``,
``verbose``) carry it here, and the code reads them without a default of its own.

What stays a check before training (``hfl.config.checks.validate``, an algorithm's
``check_config``, ``hfl.data`` and ``hfl.tree.formation``), because a type cannot say it:

- ranges (``global_rounds >= 1``, ``0 < sample_fraction <= 1`` ...) and finiteness (every NaN
  or infinite number anywhere in the config is refused with its key by ``validate``);
- allowed values of string keys (``algorithm.sampling``, ``algorithm.variant``, optimisers,
  ``dataset.partition``, ``topology.formation``, ``runtime.name``, ``model.name``): OmegaConf's
  Enum fields would hand the code Enum members instead of the strings it compares and
  JSON-copies, the sets belong to the modules that implement them, and their checks name the
  key and list the known values;
- keys of more than one shape, typed ``Any``: ``dataset.normalize`` ([mean, std], per-channel
  lists, null or ``per_feature``), ``algorithm.sample_fraction`` and ``eval_fraction`` (a number or a
  list, root first), ``topology.nodes`` (nested lists of any depth), ``algorithm.levels`` (per-depth
  optimiser overrides);
- two keys whose wrong types the existing tests pin to the check's own message
  (``tests/test_config.py``: ``algorithm.weighted=maybe``; ``tests/test_baselines.py``:
  ``algorithm.head_steps=1.5``): ``algorithm.weighted`` and ``algorithm.head_steps`` are ``Any``
  here, and validate / FedRep's check_config refuse a non-bool / non-integer naming the key.

``register()`` stores the schemas; it must run before Hydra composes from ``conf/``. It runs
when ``hfl.config.compose`` (which defines ``CONF_DIR``) is imported, and ``hfl-simulate``,
``hfl.config.compose.compose_config`` and the tests' ``compose_cfg`` call it again (it is idempotent).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from hfl.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# Fields are declared without a default (MISSING): values come from conf/*.yaml only.
# `from __future__ import annotations` is fine: OmegaConf resolves the annotations.


# ----------------------------------------------------------------------------- algorithm
@dataclass
class NodeOptConfig:
    """A B-HFL node optimiser (hfl/rules/nodeopt.py): ``optimizer`` in replace | sgd | adam | yogi |
    adagrad (checked by hfl.rules.nodeopt)."""

    optimizer: str = MISSING
    lr: float = MISSING
    momentum: float = MISSING
    beta1: float = MISSING
    beta2: float = MISSING
    tau: float = MISSING
    bias_correction: bool = MISSING


@dataclass
class AlgorithmConfig:
    """The keys every algorithm has."""

    name: str = MISSING
    strategy: str = MISSING  # module whose SERVER is the algorithm's server rule (hfl.algorithm)
    client: str = MISSING  # module with make_client
    team_rounds: int = MISSING  # K
    local_steps: int = MISSING  # L
    alpha: float = MISSING
    weighted: Any = MISSING  # true | false: checked by hfl.config.checks.validate (tests pin its message)
    min_fit_fraction: float = MISSING
    # Keys every algorithm has, with the engine's defaults (an algorithm's file may set them; the
    # defaults live here only). Per-level ones: a number (every level) or a list, root first.
    sampling: str = "children"  # children | devices (hfl.config.checks.SAMPLINGS)
    sample_fraction: Any = 1.0  # the share of its children a node asks per round; devices: of all devices
    candidates: Any = 0  # power-of-choice (hfl.node.cohort): candidates drawn per round; 0: none
    level_rounds: Optional[List[int]] = None  # rounds per call at levels 1..D-1; null: team_rounds at the lowest, 1 above
    local_labels: bool = False  # devices index their own classes (PFLEGO's heads; FedAvg/FedPer as its baselines)
    local_epochs: Optional[int] = None  # epochs of local training, where an algorithm counts epochs not steps

    # What the per-level keys give at one level (the engine reads these from NodeContext.params and
    # hfl.config.typed.algorithm_params; OmegaConf composes the fields only).
    def rounds_at(self, level: int, depth: int) -> int:
        """Rounds a node at ``level`` (1..depth-1) runs per call: ``level_rounds[level-1]`` where
        given, else ``team_rounds`` at the lowest server level and 1 above it (so FedAvg's means
        compose into one flat mean, and HierFAVG has its K rounds at the lowest level)."""
        if self.level_rounds is not None:
            return int(self.level_rounds[level - 1])
        return int(self.team_rounds) if level == depth - 1 else 1

    def fraction_at(self, level: int) -> float:
        """The fraction of its children a node at ``level`` asks per round (``sample_fraction``: one
        number for every level, or a list, root first); 1 with ``sampling=devices``, where the root
        draws devices and nodes ask the children that hold them."""
        if self.sampling == "devices":
            return 1.0
        fraction = self.sample_fraction
        return float(fraction[level] if isinstance(fraction, list | tuple) else fraction)

    def candidates_at(self, level: int) -> float:
        """The share of its children a node at ``level`` draws as candidates for a loss-aware choice
        (``candidates``, power-of-choice: hfl.node.cohort); 0: none."""
        candidates = self.candidates
        return float(candidates[level] if isinstance(candidates, list | tuple) else candidates)


@dataclass
class HierFAVGConfig(AlgorithmConfig):
    """HierFAVG's keys: those of every algorithm (the base of the FedAvg family's schemas)."""


# ------------------------------------------------------------------------------- dataset
@dataclass
class DatasetConfig:
    """The keys every dataset has."""

    name: str = MISSING
    root: Optional[str] = MISSING
    download: bool = MISSING
    partition: str = MISSING  # classes | iid | dirichlet | natural | roundrobin | clusterwise | multilevel (hfl.data)
    classes_per_device: int = MISSING
    min_per_class: int = MISSING
    size_sigma: float = MISSING
    dirichlet_alpha: float = MISSING
    min_samples_per_device: int = MISSING  # partition=dirichlet: redraw until every device has this many
    num_clusters: int = MISSING  # partition=clusterwise: K
    cluster_classes: int = MISSING  # partition=clusterwise: c classes per cluster
    level_clusters: List[int] = MISSING  # partition=multilevel: clusters per level, coarse to fine
    level_classes: Optional[List[int]] = MISSING  # partition=multilevel: classes per cluster per level; null = rule
    train_fraction: float = MISSING
    val_fraction: float = MISSING  # share of each device's training part held out for validation
    proxy_fraction: float = MISSING
    batch_size: int = MISSING


@dataclass
class VisionDatasetConfig(DatasetConfig):
    """MNIST, Fashion-MNIST, EMNIST, CIFAR-10."""

    normalize: Any = MISSING  # [mean, std], [[means...], [stds...]], per_feature or null


@dataclass
class SyntheticDatasetConfig(DatasetConfig):
    """Synthetic(alpha, beta)."""

    alpha: float = MISSING
    beta: float = MISSING
    num_features: int = MISSING
    num_classes: int = MISSING
    size_mean: float = MISSING
    min_samples: int = MISSING
    max_samples: Optional[int] = MISSING
    size_scale: int = MISSING
    lazy: bool = MISSING  # partition=natural: each device generated when asked for (hfl/data/federation.py)
    cache_mb: float = MISSING  # lazy devices kept per process within this budget


@dataclass
class SyntheticMultilevelDatasetConfig(DatasetConfig):
    """Synthetic data with nested cluster-level models (hfl/data/multilevel.py)."""

    clusters: List[int] = MISSING  # clusters per level, coarse to fine
    scales: List[float] = MISSING  # std of the global part, of each cluster level's part, of the device's own
    beta: float = MISSING
    num_features: int = MISSING
    num_classes: int = MISSING
    size_mean: float = MISSING
    min_samples: int = MISSING
    max_samples: Optional[int] = MISSING
    lazy: bool = MISSING
    cache_mb: float = MISSING


@dataclass
class HuggingFaceColumnsConfig:
    """The columns a Hugging Face dataset's rows are read from (hfl/data/huggingface.py)."""

    image: Optional[str] = MISSING  # an image or array column (or give features)
    features: Optional[List[str]] = MISSING  # numeric columns, concatenated into one vector
    text: Optional[str] = MISSING  # a text column (encoded as dataset.text says)
    label: str = MISSING
    natural_id: Optional[str] = MISSING  # natural-id partitioners' partition_by when their kwargs give none
    group: Optional[str] = MISSING  # with NaturalIdPartitioner: the level-1 nodes


@dataclass
class HuggingFaceTextConfig:
    """How a text column becomes numbers (hfl/data/huggingface.py:encode_text)."""

    encoding: str = MISSING  # hashing | chars (checked by hfl.data.huggingface)
    features: int = MISSING  # hashing: the buckets words are counted into
    length: int = MISSING  # chars: the last characters of each text kept, as ids


@dataclass
class PartitionerConfig:
    """A Flower Datasets partitioner: its class name in flwr_datasets.partitioner and its keyword arguments."""

    name: Optional[str] = MISSING
    kwargs: Dict[str, Any] = MISSING  # its keyword arguments (+dataset.partitioner.kwargs.alpha=0.5)


@dataclass
class HuggingFaceDatasetConfig(DatasetConfig):
    """Any Hugging Face dataset, from local files or the Hub (hfl/data/huggingface.py)."""

    source: str = MISSING  # huggingface
    path: Optional[str] = MISSING  # local: a save_to_disk folder, parquet/arrow/csv/json files, a folder of images
    hub: Optional[str] = MISSING  # or a Hub name (needs network)
    subset: Optional[str] = MISSING  # the Hub dataset's configuration name
    splits: Optional[List[str]] = MISSING  # pooled splits; null = all
    columns: HuggingFaceColumnsConfig = field(default_factory=HuggingFaceColumnsConfig)
    text: HuggingFaceTextConfig = field(default_factory=HuggingFaceTextConfig)
    partitioner: PartitionerConfig = field(default_factory=PartitionerConfig)  # partition=flower
    team_partitioner: PartitionerConfig = field(default_factory=PartitionerConfig)  # level-1 nodes first; name null: off
    num_classes: Optional[int] = MISSING  # null: the label's ClassLabel, else max label + 1
    image_mode: Optional[str] = MISSING  # PIL mode images are decoded to (L, RGB); null = as stored
    scale: float = MISSING  # raw values are divided by it (255 for 8-bit images)
    normalize: Any = MISSING  # [mean, std] after scaling, per_feature or null
    lazy: bool = MISSING  # each device's tensors made when first asked for
    cache_mb: float = MISSING


# --------------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    name: str = MISSING  # checked by hfl.models


@dataclass
class HiddenModelConfig(ModelConfig):
    """The models with a hidden width (MLP, DNN, CNN)."""

    hidden: int = MISSING


# ------------------------------------------------------------------------------ topology
@dataclass
class TopologyConfig:
    """Three tiers: teams of devices."""

    formation: str = MISSING  # random | by_label | explicit | tree (checked by hfl.tree.formation)
    num_teams: Optional[int] = MISSING
    devices_per_team: Optional[int] = MISSING
    team_labels: Optional[List[List[int]]] = MISSING
    teams: Optional[List[List[int]]] = MISSING


@dataclass
class TreeTopologyConfig(TopologyConfig):
    """A tree of any depth."""

    fanout: Optional[List[int]] = MISSING
    nodes: Any = MISSING  # nested lists of device ids, any depth


# ------------------------------------------------------------------------------- runtime
@dataclass
class RuntimeConfig:
    name: str = MISSING  # simulation | inprocess | deployment (checked by hfl.config.checks)
    torch_threads: int = MISSING
    # null: <run dir>/state; else a directory of its own (a Ray cluster: one every node mounts)
    state_dir: Optional[str] = None
    team_wait_seconds: float = 60.0  # how long the first global round waits for the level-1 nodes to connect
    verbose: bool = False  # Flower's and Ray's own logs on the console
    # Simulated faults (hfl.node.faults), in [0, 1) (checked by hfl.config.checks; 0 in deployment, which has real ones)
    dropout: float = MISSING  # of the devices a lowest server asks, the fraction failing each round
    dropout_nodes: float = MISSING  # of the inner nodes a node (the root included) asks, likewise
    device: str = MISSING  # auto | cpu | cuda: where devices' data, models and training live (checked by hfl.config.checks)
    batched: str = MISSING  # auto | on | off: a node's devices stepped together (hfl.accel.batched) or one by one


@dataclass
class SimulationRuntimeConfig(RuntimeConfig):
    num_cpus_per_team: float = MISSING
    num_gpus_per_team: float = MISSING  # Ray's num_gpus per team actor; fractions let team nodes share a GPU
    ray_tmp_dir: Optional[str] = MISSING
    ray_address: Optional[str] = MISSING  # null: a fresh local Ray instance; else the cluster to join
    # null: <run dir>/state; else a directory every Ray node mounts (the run's state in a folder of its own)
    state_dir: Optional[str] = MISSING
    # seconds between Flower's looks for messages (hfl.runtime.polling); null: Flower's 0.1
    poll_interval: Optional[float] = MISSING
    verbose: bool = MISSING
    batched_threads: int = MISSING  # a phase's size groups stepped at once in a team actor (hfl.accel.batched)


@dataclass
class InProcessRuntimeConfig(RuntimeConfig):
    verbose: bool = MISSING
    # the root's children fit taking turns, their batched device steps merged (hfl.node.lockstep)
    batch_siblings: bool = MISSING
    batched_threads: int = MISSING  # a phase's size groups stepped at once (hfl.accel.batched)


@dataclass
class DeploymentRuntimeConfig(RuntimeConfig):
    team_wait_seconds: float = MISSING
    device_wait_seconds: float = MISSING
    team_round_timeout: float = MISSING
    team_run_timeout: float = MISSING


# -------------------------------------------------------------------------------- logger
@dataclass
class LoggerConfig:
    """Experiment tracking (hfl/output/tracking.py): ``name`` in none | tensorboard | mlflow
    (checked by hfl.output.tracking before training)."""

    name: str = MISSING


@dataclass
class TensorBoardLoggerConfig(LoggerConfig):
    log_dir: Optional[str] = MISSING  # null: <run dir>/tensorboard; else <log_dir>/<the run's last two folders>


@dataclass
class MlflowLoggerConfig(LoggerConfig):
    tracking_uri: Optional[str] = MISSING  # null: MLFLOW_TRACKING_URI, else MLflow's default
    experiment_name: str = MISSING
    run_name: Optional[str] = MISSING  # null: the run directory's last two folders
    artifact_location: Optional[str] = MISSING  # of an experiment it creates; null: beside a sqlite database


# ---------------------------------------------------------------------------------- clock
@dataclass
class ClockConfig:
    """conf/config.yaml's ``clock``: simulated time (hfl.clock). Numbers that may be per level
    (``latency``, ``bandwidth``, ``policy``, ``deadline``, ``min_replies``, ``buffer``,
    ``concurrency``) are ``Any``: one value, or a list root first (hfl.clock checks them)."""

    enabled: bool = MISSING
    step_seconds: float = MISSING
    speed: Any = MISSING
    trace: Optional[str] = MISSING
    availability: Any = MISSING
    latency: Any = MISSING
    bandwidth: Any = MISSING
    policy: Any = MISSING
    deadline: Any = MISSING
    min_replies: Any = MISSING
    late: str = MISSING
    buffer: Any = MISSING
    concurrency: Any = MISSING
    staleness: Any = MISSING
    max_staleness: int = MISSING
    shift: Any = MISSING  # dataset shift (hfl.clock.shift)


# ---------------------------------------------------------------------------------- privacy
@dataclass
class PrivacyConfig:
    """conf/config.yaml's ``privacy``: differential privacy at one level of the tree (hfl.node.privacy,
    docs/privacy.md; hfl.config.checks.check_privacy), and secure aggregation at the lowest servers (secure_aggregation)."""

    level: Any = MISSING  # off | local | lowest | root | a node level, 0 (root) .. depth-1 (lowest servers)
    clip: Optional[float] = MISSING  # C, the norm each update is clipped to; null: none (noise needs one)
    adaptive: bool = MISSING  # C starts at clip and follows target_quantile (Andrew et al. 2021)
    target_quantile: float = MISSING
    clip_lr: float = MISSING
    count_stddev: Optional[float] = MISSING  # noise of the unclipped count; null: children / 20 (Flower's)
    noise_multiplier: float = MISSING  # sigma: noise std = sigma x C / children
    delta: float = MISSING
    target_epsilon: Optional[float] = MISSING  # the budget: the run stops before a round would spend more
    # secure aggregation at the lowest servers (hfl.node.secagg, hfl.deploy.secagg): SecAggPlusWorkflow's parameters
    secure_aggregation: bool = MISSING
    secagg_num_shares: Any = MISSING  # int: a count; float: a fraction of the round's devices
    secagg_reconstruction_threshold: Any = MISSING  # int: a count; float: a fraction of the shares
    secagg_clipping_range: float = MISSING
    secagg_quantization_range: int = MISSING
    secagg_modulus_range: int = MISSING
    secagg_max_weight: float = MISSING


# ---------------------------------------------------------------------------------- root
@dataclass
class HflConfig:
    """conf/config.yaml: the run's top-level keys. The groups are typed by their options' own
    schemas (each file names its own), not here: a new option whose file names none still
    composes, untyped (tests/test_schema.py flags it). The order is the composed config's
    (groups first, then config.yaml's keys)."""

    algorithm: Any = MISSING
    dataset: Any = MISSING
    model: Any = MISSING
    topology: Any = MISSING
    runtime: Any = MISSING
    logger: Any = MISSING  # experiment tracking (conf/logger/): not part of the run, free to change on resume
    global_rounds: int = MISSING  # T
    eval_every: int = MISSING
    eval_fraction: Any = MISSING  # a number (the lowest servers' devices) or a list, root first (hfl.config.checks)
    seed: int = MISSING
    resume: bool = MISSING  # go on with the killed run in hydra.run.dir (hfl.state.resume)
    overwrite: bool = MISSING  # a fresh run may replace the run already in hydra.run.dir
    clock: ClockConfig = MISSING  # simulated time (hfl.clock)
    privacy: PrivacyConfig = MISSING  # differential privacy (hfl.node.privacy)


# group -> {schema name -> dataclass}; a YAML file names one as /schema/<group>/<name>@_here_.
SCHEMAS: dict[str, dict[str, type]] = {
    "algorithm": {  # the bases; every algorithm's own schema sits beside its rule (ServerRule.schema)
        "base": AlgorithmConfig,
        "hierfavg": HierFAVGConfig,
    },
    "dataset": {"vision": VisionDatasetConfig, "synthetic": SyntheticDatasetConfig,
                "synthetic_multilevel": SyntheticMultilevelDatasetConfig, "huggingface": HuggingFaceDatasetConfig},
    "model": {"base": ModelConfig, "hidden": HiddenModelConfig},
    "topology": {"base": TopologyConfig, "tree": TreeTopologyConfig},
    "runtime": {"simulation": SimulationRuntimeConfig, "inprocess": InProcessRuntimeConfig,
                "deployment": DeploymentRuntimeConfig},
    "logger": {"base": LoggerConfig, "tensorboard": TensorBoardLoggerConfig, "mlflow": MlflowLoggerConfig},
}

_registered = False


def register() -> None:
    """Store the schemas in Hydra's ConfigStore (``schema/config`` for conf/config.yaml,
    ``schema/<group>/<name>`` for the groups' files). Idempotent."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="schema", name="config", node=HflConfig, provider="hfl")
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=node, provider="hfl")
    for name, node, provider in algorithm_schemas():
        store.store(group="schema/algorithm", name=name, node=node, provider=provider)
    _registered = True


SCHEMA_ENTRY = re.compile(r"^/schema/algorithm/(\w+)@_here_$")


def algorithm_schemas(conf_dir: Path = CONF_DIR) -> list[tuple[str, type, str]]:
    """The schemas that algorithms declare themselves (``ServerRule.schema``, hfl.algorithm):
    for each ``conf/algorithm/*.yaml`` naming a ``/schema/algorithm/<name>`` that is not one of
    ``SCHEMAS``, its strategy module's ``SERVER.schema``, stored under that name — so adding an
    algorithm touches no file of hfl. One that cannot be imported is skipped with a warning
    (composing it then fails naming the missing schema)."""
    import importlib
    import logging

    import yaml

    found = []
    for path in sorted((conf_dir / "algorithm").glob("*.yaml")):
        text = yaml.safe_load(path.read_text()) or {}
        names = [m.group(1) for entry in text.get("defaults") or [] if isinstance(entry, str)
                 for m in [SCHEMA_ENTRY.match(entry.strip())] if m]
        if not names or names[0] in SCHEMAS["algorithm"] or not text.get("strategy"):
            continue
        try:
            node = importlib.import_module(str(text["strategy"])).SERVER.schema
        except (ImportError, AttributeError) as exc:
            logging.getLogger("hfl").warning("conf/algorithm/%s: no schema from %s: %s", path.name, text["strategy"], exc)
            continue
        if node is not None:
            found.append((names[0], node, str(text["strategy"])))
    return found


# ------------------------------------------------------------------ Hydra's errors, one line
_KINDS = {"Integer": "an integer", "int": "an integer", "Float": "a number", "float": "a number", "bool": "true or false", "Boolean": "true or false",
          "str": "a string", "String": "a string"}


def config_error(exc: BaseException) -> ConfigError | None:
    """The ConfigError (naming the key) behind a Hydra composition error caused by the schema
    (a wrong type or an unknown key, in an override or in a file of conf/), or None when
    ``exc`` is not one."""
    from omegaconf.errors import OmegaConfBaseException

    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    where = ""
    if isinstance(cause, OmegaConfBaseException):  # an override: Hydra chains OmegaConf's error
        key, text = cause.full_key, str(cause.msg or cause).splitlines()[0].strip()
    else:  # a file: "In 'algorithm/permfl': ValidationError raised while composing config:\n<msg>\n    full_key: ..."
        found = re.search(r"^\s*full_key: (\S+)", str(exc), re.MULTILINE)
        lines = str(exc).splitlines()
        if not found or len(lines) < 2 or "raised while composing config" not in lines[0]:
            return None
        key, text = found.group(1), lines[1].strip()
        source = re.match(r"In '([^']+)'", lines[0])
        where = f" (in conf/{source.group(1)}.yaml)" if source else ""
    if not key:
        return None
    converted = re.match(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", text)
    invalid_bool = re.match(r"Value '(.*)' is not a valid bool \(type (\w+)\)", text)
    in_list = re.match(r"Value (.*) \((\w+)\) is incompatible with type hint '(\w+)'", text)
    if converted:
        value, kind = _shown(converted.group(1), converted.group(2)), _KINDS.get(converted.group(3), converted.group(3))
        return ConfigError(key, f"must be {kind}, got {value}{where}")
    if invalid_bool:
        return ConfigError(key, f"must be true or false, got {_shown(*invalid_bool.groups())}{where}")
    if in_list:
        return ConfigError(key, f"must be {_KINDS.get(in_list.group(3), in_list.group(3))}, got {in_list.group(1)}{where}")
    if re.match(r"field '.*' is not Optional", text):
        return ConfigError(key, f"must not be null{where}")
    if re.match(r"Key '.*' (is )?not in ", text):
        # Hydra's own hint ("To append to your config use +key=value") is dropped: a key no schema
        # declares is a misspelling or another option's key, which unknown_key names.
        owner = getattr(cause, "object_type", None) or _dataclass_named(re.search(r"object_type=(\w+)", str(exc)))
        return unknown_key(key, owner, where)
    return ConfigError(key, text + where)


def _shown(value: str, type_name: str) -> str:
    """A value as the user wrote it: quoted when YAML read a string."""
    return repr(value) if type_name == "str" else value


# ------------------------------------------------------------- keys nothing reads
# Hydra's ``+key=value`` / ``++key=value`` add a key even to a closed (struct) schema node, so a
# misspelt ``+algorithm.alhpa=0.5`` would compose and be silently ignored. ``check_keys`` refuses,
# after composing, every key the node's schema does not declare.

# What an algorithm is, declared by its server rule's class (hfl.algorithm.ServerRule) or its device
# client's (hfl.device.client.DeviceClient), never set in a config: a config that sets one is
# refused naming the class attribute (unknown_key).
NATURE_KEYS = {"personalized": "rule", "global_model": "rule", "level_models": "rule", "pm_base": "rule",
               "any_depth": "rule", "personal_heads": "rule", "batched": "client"}
# ``Any`` fields whose value is a mapping of fixed keys: those conf/config.yaml gives them.
CLOSED_MAPPINGS = ("clock.speed", "clock.availability", "clock.staleness", "clock.shift")


def check_keys(cfg: Any) -> None:
    """Refuse (ConfigError naming the key, with the closest real key or the option that has it) the
    first key of the composed ``cfg`` (an OmegaConf DictConfig, before ``to_container``: it still
    knows each node's schema) that nothing reads. Open on purpose: ``Any`` fields other than
    CLOSED_MAPPINGS (``algorithm.levels`` is keyed by tree depth and checked by B-HFL), options
    whose file names no schema (untyped, flagged by tests/test_schema.py), and ``hydra.*``
    (not part of the job's config)."""
    from omegaconf import DictConfig, OmegaConf

    def visit(node: DictConfig, path: str) -> None:
        owner = OmegaConf.get_type(node)
        known: set[str] | None = None
        if owner is not None and dataclasses.is_dataclass(owner):
            known = {f.name for f in dataclasses.fields(owner)}
        elif path in CLOSED_MAPPINGS:
            known = set(_conf_defaults(path))
        for name in node.keys():
            if not path and name == "hydra":  # Hydra's own config (hydra.*): not the job's, Hydra checks it
                continue
            full = f"{path}.{name}" if path else str(name)
            if known is not None and name not in known:
                raise unknown_key(full, owner, alg=node if path == "algorithm" else None)
            child = node._get_node(name)  # noqa: SLF001 - the node itself: a missing value (???) is not read
            if isinstance(child, DictConfig):
                visit(child, full)

    visit(cfg, "")


def unknown_key(key: str, owner: type | None, where: str = "", alg: Any = None) -> ConfigError:
    """The refusal of ``key``, which the schema ``owner`` (a dataclass, or None if unknown) of its
    node lacks: an algorithm's nature (NATURE_KEYS) names the class attribute that declares it
    (``alg``: the algorithm's config, where known); else "did you mean <the closest
    key>?", else the options of its group that have it ("topology.fanout ... belongs to
    topology=tree"), else the node's keys. Never ``+key``: a key no schema declares is read by nothing."""
    import difflib

    parent, _, name = key.rpartition(".")
    if parent == "algorithm" and name in NATURE_KEYS:
        kind = "server rule" if NATURE_KEYS[name] == "rule" else "device client"
        return ConfigError(key, f"is the algorithm's nature ({_class_name(alg, NATURE_KEYS[name])}.{name}), not a "
                                f"setting; its {kind}'s class declares it{where}")
    prefix = f"{parent}." if parent else ""
    if owner is not None and dataclasses.is_dataclass(owner):
        fields = [f.name for f in dataclasses.fields(owner)]
    else:
        fields = list(_conf_defaults(parent)) if parent in CLOSED_MAPPINGS else []
    providers = [f"{parent}={option}" for option, node in _options(parent).items()
                 if name in {f.name for f in dataclasses.fields(node)}]
    if providers:
        shown = " or ".join(providers[:3]) + (" ..." if len(providers) > 3 else "")
        return ConfigError(key, f"no such key in this {parent}; it belongs to {shown}{where}")
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if not close and not parent:  # a top-level key: a group's key given without its group?
        close = [f"{group}.{name}" for group in SCHEMAS for node in _group_schemas(group)
                 if name in {f.name for f in dataclasses.fields(node)}][:1]
        prefix = ""
    if close:
        return ConfigError(key, f"no such key; did you mean {prefix}{close[0]}?{where}")
    known = f"; the keys of {parent or 'the config'}: {', '.join(sorted(set(fields)))}" if fields else ""
    return ConfigError(key, f"no such key{known}{where}")


def _class_name(alg: Any, kind: str) -> str:
    """The name of the algorithm's server rule (``kind`` "rule") or device client class, else of
    their base (``ServerRule``, ``DeviceClient``) where ``alg`` is unknown or names no such class."""
    from hfl.config.checks import client_class, load_server

    try:
        return (load_server(alg) if kind == "rule" else client_class(alg)).__name__
    except (ConfigError, AttributeError, TypeError):
        return "ServerRule" if kind == "rule" else "DeviceClient"


def _group_schemas(group: str) -> list[type]:
    """Every schema of ``group``: hfl's (SCHEMAS) and, for algorithms, those beside their rules."""
    found = list(SCHEMAS[group].values())
    if group == "algorithm":
        found += [node for _, node, _ in algorithm_schemas()]
    return found


def _dataclass_named(found: re.Match | None) -> type | None:
    """A schema dataclass by its class name (Hydra's message for a file names it ``object_type=X``)."""
    if found is None:
        return None
    classes = [HflConfig, ClockConfig, NodeOptConfig, *(c for group in SCHEMAS for c in _group_schemas(group))]
    return next((c for c in classes if c.__name__ == found.group(1)), None)


def _options(group: str, conf_dir: Path = CONF_DIR) -> dict[str, type]:
    """``conf/<group>``'s options with the schema each one's file (or the option it extends) names."""
    if group not in SCHEMAS:
        return {}
    import yaml

    named = {**SCHEMAS[group]}
    if group == "algorithm":
        named.update({name: node for name, node, _ in algorithm_schemas(conf_dir)})
    entries = {}
    for path in sorted((conf_dir / group).glob("*.yaml")):
        text = yaml.safe_load(path.read_text()) or {}
        entries[path.stem] = [e.strip() for e in text.get("defaults") or [] if isinstance(e, str)]

    def schema_of(option: str, seen: frozenset = frozenset()) -> type | None:
        for entry in entries.get(option, []):
            found = re.match(rf"^/schema/{group}/(\w+)@_here_$", entry)
            if found:
                return named.get(found.group(1))
            if entry in entries and entry not in seen:  # an option extending another (fesem: femam)
                return schema_of(entry, seen | {option})
        return None

    return {option: node for option in entries for node in [schema_of(option)] if node is not None}


def _conf_defaults(path: str, conf_dir: Path = CONF_DIR) -> dict:
    """The mapping conf/config.yaml gives ``path`` (e.g. ``clock.staleness``)."""
    import yaml

    node: Any = yaml.safe_load((conf_dir / "config.yaml").read_text())
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}
