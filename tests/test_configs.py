"""The shipped configs and the override syntax of ``meshtrain.config``."""

from __future__ import annotations

import pathlib

import pytest

from meshtrain.config import Config, load_config, parse_override
from meshtrain.errors import ConfigError
from meshtrain.mesh import MeshConfig
from meshtrain.parallel.rules import AxisRule
from meshtrain.precision import Precision
from meshtrain.train import main as train_main
from models.deepseek import DeepSeekConfig
from models.llama import LlamaConfig
from models.moe import MoEConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))

# Nominal size -> accepted range of cfg.model.num_params.
EXPECTED_PARAMS = {
    "stdlib_20m": (20e6, 22e6),  # the ~20M-parameter model of the FP8 convergence comparison
    "llama_125m": (0.10e9, 0.20e9),
    "llama_1b": (1.0e9, 1.4e9),
    "llama_8b": (7.6e9, 8.4e9),
    "llama_70b": (67e9, 74e9),
    "mixtral_8x7b": (46.5e9, 46.9e9),
    "qwen3_moe_30b_a3b": (30.3e9, 30.7e9),
    # 671.0B in the main model, + 11.6B in the multi-token prediction module (DeepSeek's "685B"
    # counts its copies of the embedding and head too).
    "deepseek_v3_671b": (682.0e9, 683.0e9),
}
# Mixture-of-experts configs -> accepted range of the matmul parameters one token passes through
# (top_k experts, attention, router, head): Mixtral's "12.9B active" and Qwen3's "A3B" count the
# input embedding too.
EXPECTED_ACTIVE = {
    "mixtral_8x7b": (12.6e9, 12.9e9),
    "qwen3_moe_30b_a3b": (2.9e9, 3.1e9),
    # 37B activated (with the input embedding), + the MTP module's layer and head.
    "deepseek_v3_671b": (38.0e9, 38.5e9),
}
# The GPU-cluster configs whose layout --print-sharding prints on the 8 simulated devices.
CLUSTER_CONFIGS = ["llama_8b", "mixtral_8x7b", "qwen3_moe_30b_a3b", "deepseek_v3_671b"]


def test_configs_exist():
    names = {path.stem for path in CONFIGS}
    assert {"tiny", "moe_tiny", *EXPECTED_PARAMS} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert isinstance(cfg.model, (LlamaConfig, MoEConfig, DeepSeekConfig))
    model = cfg.model
    assert model.num_heads % model.num_kv_heads == 0 and model.head_dim % 2 == 0
    matmul = model.matmul_params if isinstance(model, LlamaConfig) else model.active_matmul_params
    assert model.num_params > matmul > 0
    if isinstance(model, DeepSeekConfig):  # the mean width of latent attention's score and value matmuls
        assert model.attention_dim == model.num_heads * (model.qk_head_dim + model.v_head_dim) // 2
    else:
        assert model.attention_dim == model.num_heads * model.head_dim


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_shipped_llama_parameter_counts(name):
    low, high = EXPECTED_PARAMS[name]
    params = load_config(REPO / "configs" / f"{name}.yaml").model.num_params
    assert low <= params <= high, f"{name}: {params / 1e9:.3f} B parameters"


@pytest.mark.parametrize("name", sorted(EXPECTED_ACTIVE))
def test_shipped_moe_active_parameters(name):
    low, high = EXPECTED_ACTIVE[name]
    model = load_config(REPO / "configs" / f"{name}.yaml").model
    assert low <= model.active_matmul_params <= high, f"{name}: {model.active_matmul_params / 1e9:.3f} B active"


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_cluster_config_layout_prints_on_8_simulated_devices(name, capsys):
    """The shipped cluster mesh resolves on 8 devices and every parameter divides (abstract: no
    compile, nothing allocated); MoE experts are split over data x fsdp (expert parallelism)."""
    assert train_main(["--config", str(REPO / "configs" / f"{name}.yaml"), "--print-sharding"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    per_device, total = (int(n) for n in rows["total"].split()[1::2])
    assert 0 < per_device < total
    if name != "llama_8b":
        assert "('data', 'fsdp')" in rows["layers.moe.gate"]


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


def _config_classes() -> list[type]:
    """Every config dataclass a run is built from: the sections, the built-in families' configs (a
    plugin's are its own, and which plugins are registered depends on what this process imported)
    and the dataclasses nested in them."""
    import dataclasses
    import typing

    from meshtrain.config import SECTIONS
    from models.api import families, family_named

    built_in = [family_named(name).config_class for name in families()
                if family_named(name).config_class.__module__.startswith("models.")]
    found, todo = [], [*SECTIONS.values(), *built_in]
    while todo:
        cls = todo.pop()
        if dataclasses.is_dataclass(cls) and cls not in found:
            found.append(cls)
            todo += [hint for hint in typing.get_type_hints(cls).values() if isinstance(hint, type)]
    return found


def test_enum_fields_given_as_plain_values_become_members_in_every_config_class():
    """Library users build configs in Python: ``MoEConfig(dispatch="dropless")`` must mean the
    member (a plain string compared with ``is`` would silently pick another branch)."""
    import dataclasses
    import enum
    import typing

    from models.common import InvalidField
    from models.moe import Dispatch

    checked = []
    for cls in _config_classes():
        for field in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls).get(field.name)
            if not (isinstance(kind, type) and issubclass(kind, enum.Enum)):
                continue
            for member in kind:
                try:
                    cls(**{field.name: member})
                except (ConfigError, ValueError):
                    continue  # not valid with the other fields' defaults
                built = cls(**{field.name: member.value})
                assert getattr(built, field.name) is member, (cls.__name__, field.name, member)
                checked.append(f"{cls.__name__}.{field.name}")
            with pytest.raises((InvalidField, ConfigError), match=f"got 'nonsense'; valid: {next(iter(kind)).value!r}"):
                cls(**{field.name: "nonsense"})
    assert {"MoEConfig.dispatch", "LlamaConfig.remat", "PipelineConfig.schedule", "TrainConfig.precision",
            "DataConfig.source", "ZeroConfig.stage", "RopeScalingConfig.kind"} <= set(checked)
    # The case: capacity mode would drop tokens where dropless keeps all 16 of a group.
    assert MoEConfig(dispatch="dropless", group_size=16).slots(16) == 16
    assert MoEConfig(dispatch="dropless").dispatch is Dispatch.DROPLESS
