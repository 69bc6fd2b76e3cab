"""PFLEGO's body + linear head models: mlp, pflego_cnn, conv4."""

from __future__ import annotations

import pytest
import torch

from hfl.errors import ConfigError
from hfl.models import MODELS, build_model
from hfl.rules.personal import head_mask
from tests.conftest import compose_cfg

IMAGES = [(1, 28, 28), (3, 32, 32)]
SHAPES = {"mlp": [(60,), *IMAGES], "pflego_cnn": IMAGES, "conv4": IMAGES}
CASES = [(name, shape) for name, shapes in SHAPES.items() for shape in shapes]


@pytest.mark.parametrize("name,shape", CASES)
def test_log_probabilities_features_and_head_last(name, shape):
    torch.manual_seed(0)
    model = build_model({"name": name}, shape, 7)
    x = torch.randn(5, *shape)
    out = model(x)
    assert out.shape == (5, 7)
    assert torch.allclose(out.exp().sum(1), torch.ones(5), atol=1e-5)
    features = model.body(x)
    assert features.shape == (5, model.feature_dim)
    assert torch.allclose(out, torch.log_softmax(model.head(features), dim=1))
    names = [n for n, _ in model.named_parameters()]
    assert names[-2:] == ["head.weight", "head.bias"]
    assert all(n.startswith("body.") for n in names[:-2])
    assert head_mask(names, 1) == [False] * (len(names) - 2) + [True, True]
    out.sum().backward()  # trainable end to end
    assert all(p.grad is not None for p in model.parameters())


def test_feature_sizes_match_the_paper():
    assert build_model({"name": "mlp"}, (1, 28, 28), 10).feature_dim == 200
    assert build_model({"name": "mlp", "hidden": 32}, (60,), 10).feature_dim == 32
    assert build_model({"name": "pflego_cnn"}, (3, 32, 32), 10).feature_dim == 192
    assert build_model({"name": "conv4"}, (1, 28, 28), 10).feature_dim == 64  # 28 -> 14 -> 7 -> 3 -> 1
    assert build_model({"name": "conv4"}, (3, 32, 32), 10).feature_dim == 64 * 2 * 2
    cnn = build_model({"name": "pflego_cnn"}, (3, 32, 32), 10)
    assert cnn.body[7].in_features == 64 * 8 * 8  # two stride-2 pools: 32 -> 16 -> 8


@pytest.mark.parametrize("name", ["pflego_cnn", "conv4"])
def test_image_models_refuse_flat_inputs(name):
    with pytest.raises(ConfigError, match="model.name.*image inputs"):
        build_model({"name": name}, (60,), 10)


def test_conv4_refuses_images_too_small():
    with pytest.raises(ConfigError, match="model.name"):
        build_model({"name": "conv4"}, (1, 8, 8), 10)


@pytest.mark.parametrize("name", ["mlp", "pflego_cnn", "conv4"])
def test_config_files(name):
    model_cfg = compose_cfg(f"model={name}")["model"]
    assert model_cfg["name"] == name and name in MODELS
    assert build_model(model_cfg, (1, 28, 28), 10).head.out_features == 10
    if name == "mlp":
        assert model_cfg["hidden"] == 200
