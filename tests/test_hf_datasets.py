"""Hugging Face datasets as a data source (hfl/data/huggingface.py): devices equal Flower Datasets'
partitions for the same seed, natural ids as devices and groups as teams, hfl's own partitions on
the same data, one-line refusals, a natural tree trained end to end with PerMFL and B-HFL, resumed;
text columns (a hashed bag of words, character ids); the FEMNIST preset with LeNet. Ray, SIGKILL
and the deployed device: tests/test_hf_datasets_runtimes.py; a deployment: tests/test_hf_deployment.py.

The datasets are made here, offline: the MNIST test split of ../shared/data (seeded random digits
where it is absent) with a synthetic ``writer`` column (12 writers, strings) and ``group`` column
(writer's number mod 3), saved with ``save_to_disk``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
partitioners = pytest.importorskip("flwr_datasets.partitioner")

from hfl.data import huggingface  # noqa: E402
from hfl.data.federation import LazyDevices, build_federation, device_sizes  # noqa: E402
from hfl.data.partition import split_train_val_test  # noqa: E402
from hfl.errors import ConfigError  # noqa: E402
from hfl.runtime.simulate import run  # noqa: E402
from tests.conftest import compose_cfg  # noqa: E402

MNIST = Path(__file__).parents[1] / ".." / "shared" / "data" / "MNIST" / "raw"
ROWS = 3000
WRITERS, GROUPS = 12, 3
# Fast runs: MCLR, 2 global rounds, a few steps, in process.
FAST = ["model=mclr", "global_rounds=2", "algorithm.team_rounds=2", "algorithm.local_steps=10", "algorithm.alpha=0.1",
        "dataset.batch_size=32", "runtime=inprocess", "runtime.torch_threads=1"]


def _digits() -> tuple[np.ndarray, np.ndarray]:
    if (MNIST / "t10k-images-idx3-ubyte").exists():
        from torchvision.datasets.mnist import read_image_file, read_label_file

        return (read_image_file(str(MNIST / "t10k-images-idx3-ubyte")).numpy()[:ROWS],
                read_label_file(str(MNIST / "t10k-labels-idx1-ubyte")).numpy()[:ROWS].astype(np.int64))
    gen = np.random.default_rng(0)
    return gen.integers(0, 256, (ROWS, 28, 28), dtype=np.uint8), gen.integers(0, 10, ROWS).astype(np.int64)


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, y = _digits()
    writer = np.random.default_rng(1).integers(0, WRITERS, len(y))
    return x, y, writer


@pytest.fixture(scope="module")
def saved(tmp_path_factory, digits) -> Path:
    """The dataset, saved with save_to_disk: image (uint8 28x28), label (ClassLabel), writer, group."""
    x, y, writer = digits
    features = datasets.Features({"image": datasets.Array2D((28, 28), "uint8"),
                                  "label": datasets.ClassLabel(num_classes=10),
                                  "writer": datasets.Value("string"), "group": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": list(x), "label": y, "writer": [f"w{w:02d}" for w in writer],
                                     "group": writer % GROUPS}, features=features)
    path = tmp_path_factory.mktemp("hf") / "mnist_writers"
    ds.save_to_disk(str(path))
    return path


def cfg_of(path: Path, *overrides: str) -> dict:
    return compose_cfg("dataset=huggingface", f"dataset.path={path}", *overrides)


def natural(path: Path, *overrides: str) -> dict:
    """Writers as devices, groups as teams (3 teams of 4 writers)."""
    return cfg_of(path, "dataset.partitioner.name=NaturalIdPartitioner", "dataset.columns.natural_id=writer",
                  "dataset.columns.group=group", "topology=sequential", f"topology.num_teams={GROUPS}",
                  "topology.devices_per_team=null", *overrides)


def federation(cfg: dict):
    return build_federation(cfg["dataset"], cfg["topology"], cfg["seed"])


def floats(images: np.ndarray) -> np.ndarray:
    """The default preprocessing: (x / 255 - 0.5) / 0.5, one channel."""
    return ((images.astype(np.float32) / 255.0 - 0.5) / 0.5)[:, None]


def assert_device_is_partition(fed, d: int, part, seed: int) -> None:
    """Device d's train and test splits are its partition's rows, split as hfl splits every device."""
    table = part.with_format("numpy")
    px, py = np.asarray(table["image"][:]), np.asarray(table["label"][:])
    train, _, test = split_train_val_test(np.arange(len(py)), 0.75, 0.0, seed, d)
    data = fed.devices[d]
    np.testing.assert_array_equal(data.y_train.numpy(), py[train])
    np.testing.assert_array_equal(data.y_test.numpy(), py[test])
    np.testing.assert_allclose(data.x_train.numpy(), floats(px[train]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(data.x_test.numpy(), floats(px[test]), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- devices = Flower's partitions
def test_dirichlet_devices_equal_flower_datasets_partitions_for_the_same_seed(saved):
    cfg = cfg_of(saved, "++dataset.partitioner={name: DirichletPartitioner, kwargs: {alpha: 0.3}}",
                 "topology=sequential", "topology.num_teams=2", "topology.devices_per_team=5", "seed=7")
    fed = federation(cfg)
    assert isinstance(fed.devices, LazyDevices) and fed.devices.made == 0  # nothing made before a node asks
    assert len(fed.devices) == 10 and fed.input_shape == (1, 28, 28) and fed.num_classes == 10
    flower = partitioners.DirichletPartitioner(num_partitions=10, partition_by="label", alpha=0.3, seed=7)
    flower.dataset = datasets.load_from_disk(str(saved))
    sizes = []
    for d in range(10):
        assert_device_is_partition(fed, d, flower.load_partition(d), seed=7)
        sizes.append(sum(device_sizes(fed, d)))
    assert sum(sizes) == ROWS and len(set(sizes)) > 1  # every row once, non-IID sizes
    other = federation({**cfg, "seed": 8})  # another seed, another split
    assert not np.array_equal(other.devices[0].y_train.numpy(), fed.devices[0].y_train.numpy())


def test_natural_ids_are_the_devices_and_the_group_column_the_teams(saved, digits):
    _, _, writer = digits
    cfg = natural(saved)
    fed = federation(cfg)
    assert len(fed.devices) == WRITERS
    # NaturalIdPartitioner numbers the sorted ids: device d is writer d ("w00" .. "w11"); group = writer % 3
    assert fed.level1_devices == [[d for d in range(WRITERS) if d % GROUPS == g] for g in range(GROUPS)]
    flower = partitioners.NaturalIdPartitioner(partition_by="writer")
    flower.dataset = datasets.load_from_disk(str(saved))
    for d in (0, 5, 11):
        assert_device_is_partition(fed, d, flower.load_partition(d), seed=cfg["seed"])
        assert sum(device_sizes(fed, d)) == int(np.sum(writer == d))


def test_grouped_natural_ids_make_teams_of_writers(saved):
    cfg = cfg_of(saved, "++dataset.partitioner={name: GroupedNaturalIdPartitioner, kwargs: {group_size: 5, "
                        "mode: drop-reminder, sort_unique_ids: true}}", "dataset.columns.natural_id=writer",
                 "topology=sequential", "topology.num_teams=null", "topology.devices_per_team=null")
    pool = huggingface.load_pool(cfg["dataset"])
    split = huggingface.flower_split(cfg["dataset"], pool, cfg["topology"], cfg["seed"])
    assert split.natural_ids == [f"w{w:02d}" for w in range(10)]  # 12 writers, groups of 5: the last 2 dropped
    assert split.teams == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    flower = partitioners.GroupedNaturalIdPartitioner(partition_by="writer", group_size=5, mode="drop-reminder",
                                                      sort_unique_ids=True)
    flower.dataset = pool.dataset
    for t, team in enumerate(split.teams):
        rows = np.sort(np.asarray(flower.load_partition(t)[huggingface.ROW]))
        np.testing.assert_array_equal(np.sort(np.concatenate([split.parts[d] for d in team])), rows)
    assert federation(cfg).level1_devices == split.teams


def test_a_partitioner_per_level_splits_teams_then_their_devices(saved):
    """Teams by Dirichlet over the labels, each team's rows among its devices by Dirichlet too: each
    device equals Flower Datasets' partition of its team's partition, with the same seed."""
    cfg = cfg_of(saved, "++dataset.team_partitioner={name: DirichletPartitioner, kwargs: {alpha: 0.5}}",
                 "++dataset.partitioner={name: DirichletPartitioner, kwargs: {alpha: 1.0, min_partition_size: 5}}",
                 "topology=sequential", "topology.num_teams=3", "topology.devices_per_team=4", "seed=3")
    fed = federation(cfg)
    assert fed.level1_devices == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    teams = partitioners.DirichletPartitioner(num_partitions=3, partition_by="label", alpha=0.5, seed=3)
    teams.dataset = datasets.load_from_disk(str(saved))
    for t in range(3):
        inner = partitioners.DirichletPartitioner(num_partitions=4, partition_by="label", alpha=1.0,
                                                  min_partition_size=5, seed=3)
        inner.dataset = teams.load_partition(t)
        for j in range(4):
            assert_device_is_partition(fed, 4 * t + j, inner.load_partition(j), seed=3)
    # the teams by writer group (natural ids at level 1), 2 IID devices in each
    by_group = federation(cfg_of(saved, "dataset.team_partitioner.name=NaturalIdPartitioner",
                                 "+dataset.team_partitioner.kwargs.partition_by=group",
                                 "topology=sequential", "topology.num_teams=null", "topology.devices_per_team=2"))
    assert len(by_group.level1_devices) == GROUPS and len(by_group.devices) == 2 * GROUPS


def test_hfl_partitions_on_a_hugging_face_dataset_equal_them_on_the_same_pool(saved, digits):
    """partition=iid / classes (hfl's own) read the Hugging Face pool as they read MNIST's."""
    x, y, _ = digits
    from hfl.data import partition as hfl_partition

    for extra, expected in [(["dataset.partition=iid"], hfl_partition.partition_iid(y, 6, 0)),
                            (["dataset.partition=classes", "dataset.min_per_class=5"], None)]:
        cfg = cfg_of(saved, *extra, "topology=sequential", "topology.num_teams=2", "topology.devices_per_team=3")
        fed = federation(cfg)
        if expected is not None:
            for d, idx in enumerate(expected):
                train, _, _ = split_train_val_test(idx, 0.75, 0.0, 0, d)
                np.testing.assert_array_equal(fed.devices[d].y_train.numpy(), y[train])
                np.testing.assert_allclose(fed.devices[d].x_train.numpy(), floats(x[train]), atol=1e-6)
        else:  # pFedMe's classes partition: every device holds its two classes only
            for d in range(6):
                assert set(np.unique(fed.devices[d].y_train.numpy())) <= {d % 10, (d + 1) % 10}
            assert fed.device_classes == [sorted([d % 10, (d + 1) % 10]) for d in range(6)]


def test_parquet_files_and_string_labels_load(tmp_path, digits, monkeypatch):
    x, y, _ = digits
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    names = np.array(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"])
    flat = {f"p{i}": x[:200].reshape(200, -1)[:, i].astype(np.float32) for i in range(0, 784, 98)}
    datasets.Dataset.from_dict({**flat, "digit": names[y[:200]]}).to_parquet(str(tmp_path / "d.parquet"))
    cfg = compose_cfg("dataset=huggingface", f"dataset.path={tmp_path / 'd.parquet'}", "dataset.columns.image=null",
                      f"dataset.columns.features=[{','.join(flat)}]", "dataset.columns.label=digit", "dataset.scale=1",
                      "dataset.normalize=null", "topology=sequential", "topology.num_teams=2",
                      "topology.devices_per_team=2")
    fed = federation(cfg)
    assert fed.input_shape == (8,) and fed.num_classes == 10  # labels encoded by sorted name
    got = np.concatenate([np.concatenate([d.x_train.numpy(), d.x_test.numpy()]) for d in fed.devices])
    want = np.stack(list(flat.values()), axis=1)
    np.testing.assert_array_equal(got[np.lexsort(got.T)], want[np.lexsort(want.T)])  # the same rows, unscaled


def test_a_folder_of_images_loads_in_the_mode_asked(tmp_path, digits, monkeypatch):
    from PIL import Image

    x, y, _ = digits
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    for i in range(40):  # RGB files in one folder per class (imagefolder's layout)
        (tmp_path / "images" / f"c{y[i]}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(x[i]).convert("RGB").save(tmp_path / "images" / f"c{y[i]}" / f"{i}.png")
    shapes = {}
    for mode in ("null", "L"):
        cfg = compose_cfg("dataset=huggingface", f"dataset.path={tmp_path / 'images'}", f"dataset.image_mode={mode}",
                          "dataset.partitioner.name=IidPartitioner", "topology=sequential", "topology.num_teams=2",
                          "topology.devices_per_team=2")
        fed = federation(cfg)
        shapes[mode] = fed.input_shape
        assert fed.num_classes == len(set(y[:40].tolist()))  # one class per folder
        assert sum(sum(device_sizes(fed, d)) for d in range(4)) == 40
    assert shapes == {"null": (3, 28, 28), "L": (1, 28, 28)}
    grey = fed.devices[0].x_train.numpy()
    assert grey.min() >= -1.0 and grey.max() <= 1.0 and grey.max() > 0.5  # (x/255 - 0.5)/0.5


# ---------------------------------------------------------------- refusals, one line naming the key
@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["dataset.columns.label=digit"], "dataset.columns.label", "no column 'digit'"),
    (["dataset.columns.natural_id=author", "dataset.partitioner.name=NaturalIdPartitioner"],
     "dataset.columns.natural_id", "no column 'author'"),
    (["dataset.partitioner.name=Dirichlet"], "dataset.partitioner.name", "unknown partitioner"),
    (["dataset.partitioner.name=DirichletPartitioner", "+dataset.partitioner.kwargs.beta=1"],
     "dataset.partitioner.kwargs.beta", "takes no argument"),
    (["++dataset.partitioner={name: ShardPartitioner, kwargs: {shard_size: 400, num_shards_per_partition: 2}}"],
     "dataset.partitioner", "cannot make 6 devices"),
    (["++dataset.partitioner={name: InnerDirichletPartitioner, kwargs: {partition_sizes: [10, 10], alpha: 1}}"],
     "dataset.partitioner", "makes 2 partitions but the topology has 6 devices"),
    (["dataset.partitioner.name=NaturalIdPartitioner", "dataset.columns.natural_id=writer"],
     "topology.devices_per_team", "but the federation has 12 devices"),
    (["dataset.partitioner.name=NaturalIdPartitioner", "dataset.columns.natural_id=writer",
      "dataset.columns.group=group"], "topology.num_teams", "forms 3 level-1 nodes"),
    (["dataset.partitioner.name=NaturalIdPartitioner", "dataset.columns.natural_id=label",
      "dataset.columns.group=group", "topology.num_teams=3", "topology.devices_per_team=null"],
     "dataset.columns.group", "a device must be in one group"),
    (["dataset.partition=natural"], "dataset.partition", "NaturalIdPartitioner"),
    (["dataset.partition=iid", "dataset.columns.group=group"], "dataset.columns.group", "partition=flower"),
    (["dataset.partitioner.name=IidPartitioner", "dataset.columns.group=group"], "dataset.columns.group",
     "not IidPartitioner"),
    (["dataset.splits=[train]"], "dataset.splits", "no splits"),
    (["dataset.team_partitioner.name=IidPartitioner", "topology.devices_per_team=null"],
     "topology.devices_per_team", "each level-1 node's device count"),
    (["dataset.team_partitioner.name=IidPartitioner", "dataset.partitioner.name=NaturalIdPartitioner",
      "dataset.columns.natural_id=writer"], "dataset.team_partitioner", "NaturalIdPartitioner forms them itself"),
    (["++dataset.team_partitioner={name: InnerDirichletPartitioner, kwargs: {partition_sizes: [10], alpha: 1}}"],
     "dataset.team_partitioner", "makes 1 partitions but the topology has 2 level-1 nodes"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_key(saved, overrides, key, words):
    cfg = cfg_of(saved, "topology=sequential", "topology.num_teams=2", "topology.devices_per_team=3", *overrides)
    with pytest.raises(ConfigError) as info:
        federation(cfg)
    message = str(info.value)
    assert message.startswith(key) and words in message and "\n" not in message, message


def test_a_dataset_that_cannot_be_loaded_names_what_to_do(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as on this machine, without 24 s of retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for overrides, key, words in [
        (["dataset=femnist"], "dataset.hub", "save_to_disk('data/flwrlabs_femnist')"),
        (["dataset=cifar10_dirichlet"], "dataset.hub", "set dataset.path=data/uoft-cs_cifar10 dataset.hub=null"),
        (["dataset=huggingface", f"dataset.path={tmp_path / 'absent'}"], "dataset.path", "does not exist"),
        (["dataset=huggingface"], "dataset.path", "give exactly one of"),
    ]:
        with pytest.raises(ConfigError) as info:
            federation(compose_cfg(*overrides))
        message = str(info.value)
        assert message.startswith(key) and words in message and "\n" not in message, message


# ---------------------------------------------------------------- end to end: writers as devices, groups as teams
@pytest.mark.parametrize("algorithm", [[], ["algorithm=bhfl", "algorithm.team_rounds=1"]], ids=["permfl", "bhfl"])
def test_a_natural_tree_trains_end_to_end(saved, tmp_path, algorithm):
    cfg = natural(saved, *FAST, *algorithm)
    summary = run(cfg, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["failures"] == 0 and len(lines) == 2
    key, floor = ("pm_accuracy", 0.2) if not algorithm else ("gm_accuracy", 0.4)  # measured: 0.26, 0.59
    assert all(line[key] is not None for line in lines)
    assert lines[-1][key] > max(floor, lines[0][key])  # digits learnt above chance (0.1), better each round
    assert np.isfinite(summary["final"][key])


def test_a_natural_tree_resumed_equals_the_uninterrupted_run(saved, tmp_path, monkeypatch):
    from tests.test_resume import assert_resumed_equals_whole

    assert_resumed_equals_whole(natural(saved, *FAST, "global_rounds=3"), tmp_path, monkeypatch, "fit", 2)


# ---------------------------------------------------------------- text columns
WORDS = (["rain", "cold", "grey", "storm", "wind", "snow"], ["sun", "warm", "bright", "beach", "summer", "clear"])


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    """400 short texts by 8 users: class c's words from WORDS[c], with shared filler words."""
    gen = np.random.default_rng(2)
    label = gen.integers(0, 2, 400)
    text = [" ".join([*gen.choice(WORDS[c], 3), *gen.choice(["the", "a", "Day", "is"], 2)]) for c in label]
    path = tmp_path_factory.mktemp("hf") / "texts"
    datasets.Dataset.from_dict({"text": text, "label": label, "user": [f"u{u}" for u in gen.integers(0, 8, 400)]}
                               ).save_to_disk(str(path))
    return path


def text_cfg(path: Path, *overrides: str) -> dict:
    """A text dataset's keys, as a user sets them (typed by HuggingFaceDatasetConfig)."""
    return cfg_of(path, "dataset.columns.image=null", "dataset.columns.text=text", "dataset.scale=1",
                  "dataset.normalize=null", "dataset.partitioner.name=NaturalIdPartitioner",
                  "dataset.columns.natural_id=user", "topology=sequential", "topology.num_teams=2",
                  "topology.devices_per_team=null", *overrides)


def test_a_text_column_hashed_into_a_bag_of_words_equals_scikit_learns_per_device(texts):
    from sklearn.feature_extraction.text import HashingVectorizer

    fed = federation(text_cfg(texts, "dataset.text.encoding=hashing", "dataset.text.features=64"))
    assert fed.input_shape == (64,) and len(fed.devices) == 8 and fed.num_classes == 2
    flower = partitioners.NaturalIdPartitioner(partition_by="user")
    flower.dataset = datasets.load_from_disk(str(texts))
    vectorizer = HashingVectorizer(n_features=64, alternate_sign=False, norm=None, token_pattern=r"(?u)\b\w+\b")
    for d in (0, 3, 7):
        part = flower.load_partition(d)
        train, _, test = split_train_val_test(np.arange(len(part)), 0.75, 0.0, 0, d)
        want = vectorizer.transform(part["text"]).toarray().astype(np.float32)
        np.testing.assert_array_equal(fed.devices[d].x_train.numpy(), want[train])
        np.testing.assert_array_equal(fed.devices[d].x_test.numpy(), want[test])
        np.testing.assert_array_equal(fed.devices[d].y_test.numpy(), np.asarray(part["label"])[test])
        assert fed.devices[d].x_train.numpy().sum(1).tolist() == [5.0] * len(train)  # 5 words a text


def test_hashed_text_stays_sparse_in_the_pool_and_is_z_scored_as_dense_counts_would_be(texts):
    """The pool keeps the counts sparse (a device's rows are made dense when it is made);
    normalize=per_feature z-scores them with the dense pool's mean and std."""
    from sklearn.feature_extraction.text import HashingVectorizer

    cfg = text_cfg(texts, "dataset.text.encoding=hashing", "dataset.text.features=32", "dataset.normalize=per_feature")
    pool = huggingface.load_pool(cfg["dataset"])
    assert huggingface._sparse(pool.x) and pool.x.nnz <= 400 * 5  # noqa: SLF001 - 5 words a text, of 32 buckets
    dense = HashingVectorizer(n_features=32, alternate_sign=False, norm=None, token_pattern=r"(?u)\b\w+\b"
                              ).transform(datasets.load_from_disk(str(texts))["text"]).toarray()
    want = ((dense - dense.mean(0)) / (dense.std(0) + 1e-3)).astype(np.float32)
    fed = federation(cfg)
    flower = partitioners.NaturalIdPartitioner(partition_by="user")
    flower.dataset = pool.dataset
    rows = np.asarray(flower.load_partition(4)[huggingface.ROW])
    train, _, _ = split_train_val_test(np.arange(len(rows)), 0.75, 0.0, 0, 4)
    np.testing.assert_allclose(fed.devices[4].x_train.numpy(), want[rows[train]], rtol=1e-5, atol=1e-5)


def test_a_text_column_as_character_ids_reads_back_as_each_texts_end(texts):
    fed = federation(text_cfg(texts, "dataset.text.encoding=chars", "dataset.text.length=12"))
    assert fed.input_shape == (12,)
    source = datasets.load_from_disk(str(texts))
    alphabet = sorted(set("".join(source["text"])))  # id i + 1 = the i-th character of the pool, sorted
    flower = partitioners.NaturalIdPartitioner(partition_by="user")
    flower.dataset = source
    part = flower.load_partition(2)
    train, _, _ = split_train_val_test(np.arange(len(part)), 0.75, 0.0, 0, 2)
    ids = fed.devices[2].x_train.numpy().astype(int)
    decoded = ["".join(alphabet[i - 1] for i in row if i) for row in ids]
    assert decoded == [part["text"][i][-12:] for i in train]


def test_a_natural_tree_learns_from_hashed_text(texts, tmp_path):
    """PerMFL over the bag of words (mclr): the users' models tell the two vocabularies apart."""
    cfg = text_cfg(texts, "dataset.text.encoding=hashing", "dataset.text.features=128", *FAST, "global_rounds=3")
    summary = run(cfg, tmp_path / "run")
    pm = [json.loads(line)["pm_accuracy"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["failures"] == 0 and pm[-1] > max(0.75, pm[0]), pm  # chance: 0.5; measured 0.85 after 3 rounds


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["dataset.text.encoding=words"], "dataset.text.encoding", "unknown text encoding 'words'"),
    (["dataset.columns.features=[label]"], "dataset.columns.image", "exactly one of"),
    (["dataset.text.features=0"], "dataset.text.features", ">= 1"),
])
def test_bad_text_settings_are_refused_in_one_line(texts, overrides, key, words):
    cfg = text_cfg(texts, *overrides)
    with pytest.raises(ConfigError) as info:
        federation(cfg)
    assert str(info.value).startswith(key) and words in str(info.value) and "\n" not in str(info.value), info.value


# ---------------------------------------------------------------- FEMNIST with the B-HFL prototype's LeNet
def test_the_femnist_bhfl_preset_trains_lenet_on_a_femnist_shaped_dataset(tmp_path, digits):
    """experiment=femnist_bhfl on a local dataset with FEMNIST's columns (image, writer_id, hsf_id,
    character: 62 classes): 8 writers in 2 HSF series, one B-HFL round in process with LeNet, whose
    parameters are those of the layer sizes the notes give (6@5x5, 16@5x5, 256 -> 120 -> 84 -> 62)."""
    from hfl.models import build_model

    x, y, _ = digits
    writer = np.random.default_rng(3).integers(0, 8, 400)
    datasets.Dataset.from_dict(
        {"image": list(x[:400]), "writer_id": [f"f{w:04d}" for w in writer], "hsf_id": writer % 2,
         "character": y[:400] + 10 * (writer[:400] % 6)},  # 0..59 of 62
        features=datasets.Features({"image": datasets.Array2D((28, 28), "uint8"), "writer_id": datasets.Value("string"),
                                    "hsf_id": datasets.Value("int64"),
                                    "character": datasets.ClassLabel(num_classes=62)}),
    ).save_to_disk(str(tmp_path / "femnist"))
    cfg = compose_cfg("experiment=femnist_bhfl", "dataset.hub=null", f"dataset.path={tmp_path / 'femnist'}",
                      "dataset.image_mode=null", "global_rounds=1", "algorithm.local_steps=5", "runtime=inprocess",
                      "runtime.torch_threads=1")
    fed = federation(cfg)
    assert len(fed.devices) == 8 and len(fed.level1_devices) == 2 and fed.num_classes == 62
    lenet = build_model(cfg["model"], fed.input_shape, fed.num_classes)
    want = (1 * 25 * 6 + 6) + (6 * 25 * 16 + 16) + (256 * 120 + 120) + (120 * 84 + 84) + (84 * 62 + 62)
    assert sum(p.numel() for p in lenet.parameters()) == want
    summary = run(cfg, tmp_path / "run")
    assert summary["failures"] == 0 and np.isfinite(summary["final"]["gm_accuracy"])
