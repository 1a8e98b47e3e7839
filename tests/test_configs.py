"""The shipped configs and the override syntax of ``meshtrain.config``."""

from __future__ import annotations

import pathlib

import pytest

from meshtrain.config import Config, load_config, parse_override
from meshtrain.errors import ConfigError
from meshtrain.mesh import MeshConfig
from meshtrain.parallel.rules import AxisRule
from meshtrain.precision import Precision
from models.llama import LlamaConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))

# Nominal size -> accepted range of cfg.model.num_params.
EXPECTED_PARAMS = {
    "llama_125m": (0.10e9, 0.20e9),
    "llama_1b": (1.0e9, 1.4e9),
    "llama_8b": (7.6e9, 8.4e9),
    "llama_70b": (67e9, 74e9),
}


def test_configs_exist():
    names = {path.stem for path in CONFIGS}
    assert {"tiny", *EXPECTED_PARAMS} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert isinstance(cfg.model, LlamaConfig)
    model = cfg.model
    assert model.num_heads % model.num_kv_heads == 0 and model.head_dim % 2 == 0
    assert model.num_params > model.matmul_params > 0
    assert model.attention_dim == model.num_heads * model.head_dim


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_shipped_llama_parameter_counts(name):
    low, high = EXPECTED_PARAMS[name]
    params = load_config(REPO / "configs" / f"{name}.yaml").model.num_params
    assert low <= params <= high, f"{name}: {params / 1e9:.3f} B parameters"


def test_override_int():
    cfg = load_config(None, ["mesh.data=2"])
    assert cfg.mesh.data == 2 and type(cfg.mesh.data) is int


def test_override_enum():
    cfg = load_config(None, ["train.precision=bf16"])
    assert cfg.train.precision is Precision.BF16


def test_override_axis_rule():
    cfg = load_config(None, ["sharding.rules.vocab={params: null, activations: tensor}"])
    assert cfg.sharding.rules == {"vocab": AxisRule(params=None, activations="tensor")}
    rules = cfg.sharding.resolve()
    assert rules.table["vocab"] == AxisRule(params=None, activations="tensor")
    assert rules.name.endswith("+overrides")


def test_overrides_apply_over_the_file_in_order():
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["train.steps=7", "train.steps=9"])
    assert cfg.train.steps == 9
    assert cfg.train.batch_size == 32  # untouched fields keep the file's values


def test_parse_override_values_are_yaml():
    assert parse_override("train.steps=10") == ("train.steps", 10)
    assert parse_override("optimizer.learning_rate=3.0e-4") == ("optimizer.learning_rate", 3e-4)
    # YAML 1.1 reads 3e-4 as a string; the float field still accepts it.
    assert load_config(None, ["optimizer.learning_rate=3e-4"]).optimizer.learning_rate == 3e-4
    assert parse_override("run.dir=") == ("run.dir", "")
    with pytest.raises(ConfigError):
        parse_override("train.steps")


@pytest.mark.parametrize("mesh, expected", [
    (MeshConfig(data=1, fsdp=-1, tensor=1, stage=1), {"data": 1, "fsdp": 8, "tensor": 1, "stage": 1}),
    (MeshConfig(data=2, fsdp=-1, tensor=2, stage=1), {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}),
    (MeshConfig(data=-1, fsdp=1, tensor=4, stage=1), {"data": 2, "fsdp": 1, "tensor": 4, "stage": 1}),
    (MeshConfig(data=2, fsdp=2, tensor=2, stage=1), {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}),
])
def test_mesh_fill_resolves_against_8_devices(mesh, expected):
    assert mesh.resolve(8) == expected


def test_mesh_fill_that_cannot_divide():
    with pytest.raises(ConfigError) as err:
        MeshConfig(data=3, fsdp=-1).resolve(8)
    assert err.value.field == "mesh.fsdp"
