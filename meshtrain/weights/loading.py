"""Loading a model for the tools (``convert``, ``export``, ``logits``, ``generate``): an HF directory,
a meshtrain export or a run (its checkpoints) onto a mesh, each device reading only its shards.

The model family comes from what the directory records (``config.json``'s ``model_type``, the
export's or checkpoint's ``model`` section); parameters come back in model layer order, whatever
pipeline wrote them (``RunCheckpoints.restore`` converts).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pathlib
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshtrain import jsonio
from meshtrain.checkpoint import CHECKPOINT_DIR, Restored, RunCheckpoints, UnreadableCheckpoint, resolve_restore_path
from meshtrain.cli import use_host_devices
from meshtrain.config import Config, UntrustedPlugin, config_from_dict, load_config, model_dict, to_dict
from meshtrain.distributed import log
from meshtrain.errors import ConfigError
from meshtrain.mesh import make_mesh
from meshtrain.parallel.activations import activation_sharding
from meshtrain.parallel.layer_order import LayerOrder
from meshtrain.parallel.layout import Layout, abstract_model
from meshtrain.parallel.rules import ShardingRules
from meshtrain.parallel.sharding import named_shardings
from meshtrain.train_config import TrainConfig
from meshtrain.trainer import ShardedState
from meshtrain.weights import hf
from meshtrain.weights.export_format import EXPORT_META, PARAMS_DIR, check_params, load_params
from models.api import DecoderModel, family_of
from models.common import ActivationSharding


class SourceKind(str, enum.Enum):
    HF = "hf"  # config.json + safetensors
    EXPORT = "export"  # params/ + meshtrain.json (python -m meshtrain.export, convert from-hf)
    RUN = "run"  # a run directory, its checkpoints/ or one step directory


@dataclasses.dataclass
class LoadedModel:
    """A model's config and parameters (fp32, in their shardings on ``mesh``), ready to run."""

    cfg: Any  # the family's model config
    graphdef: Any
    params: nnx.State
    mesh: Mesh
    rules: ShardingRules
    kind: SourceKind
    path: pathlib.Path
    hf_config: dict | None = None  # the config.json an HF model (or an import of one) came with
    hf_dtypes: dict[str, str] | None = None  # its tensors' dtypes
    home: pathlib.Path | None = None  # the directory that holds its tokenizer.json, if it has one
    trained_on_bytes: bool | None = None  # whether it learned UTF-8 bytes as ids (None: unknown)

    @property
    def shard(self) -> ActivationSharding:
        return activation_sharding(self.rules, self.mesh)

    def module(self) -> DecoderModel:
        return nnx.merge(self.graphdef, self.params)


def source_kind(path: str | pathlib.Path, *, field: str) -> SourceKind:
    """What kind of model directory ``path`` is."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ConfigError(field, f"no such directory: {path}")
    if (root / hf.CONFIG_FILE).is_file():
        return SourceKind.HF
    if (root / PARAMS_DIR).is_dir():
        return SourceKind.EXPORT
    if (root / CHECKPOINT_DIR).is_dir() or (root / "meta").exists() or any(
            p.name.isdigit() for p in root.iterdir()):
        return SourceKind.RUN
    raise ConfigError(field, f"{path} is not a model directory: expected an HF directory (config.json), "
                      f"a meshtrain export ({PARAMS_DIR}/) or a run directory ({CHECKPOINT_DIR}/)")


def _check_no_stages(mesh: Mesh) -> None:
    if mesh.shape["stage"] != 1:
        raise ConfigError("mesh.stage", f"is {mesh.shape['stage']}; loading for inference or conversion "
                          "uses no pipeline stages (use 1)")


def inference_layout(model_cfg: Any, mesh: Mesh, rules: ShardingRules,
                   abstract_params: nnx.State | None = None) -> Layout:
    """The layout of ``model_cfg`` on ``mesh`` for inference or conversion (checked: no pipeline,
    every parameter dimension divisible by its split)."""
    _check_no_stages(mesh)
    layout = Layout.of(model_cfg, mesh.shape, rules, TrainConfig(batch_size=mesh.devices.size),
                       abstract_params=abstract_params)
    layout.check()
    return layout


def load_model(path: str | pathlib.Path, mesh: Mesh, rules: ShardingRules, *, step: int | None = None,
               field: str = "--model", trust_plugin: bool = False) -> LoadedModel:
    """The model at ``path`` (an HF directory, a meshtrain export or a run) on ``mesh``.

    Each device reads only its own shards. A run's checkpoint (the latest, or ``step``) is restored
    in full (parameters and optimizer moments) with its layers in model order. A ``model.plugin``
    that the run or export records is imported only with ``trust_plugin`` (``--trust-plugin``).
    """
    root = pathlib.Path(path)
    kind = source_kind(root, field=field)
    if kind is SourceKind.RUN:
        _check_no_stages(mesh)
        cfg, sharded, restored = restore_run(root, mesh, rules, step=step, field=field, trust_plugin=trust_plugin)
        params = sharded.model_params(restored.state, jnp.float32)  # a train.lora run's adapters merged in
        return LoadedModel(cfg.model, sharded.graphdef, params, mesh, sharded.rules,
                           SourceKind.RUN, restored.path, hf_config=_hf_source_config(cfg),
                           home=restored.path.parent.parent, trained_on_bytes=_trained_on_bytes(to_dict(cfg)))
    if kind is SourceKind.HF:
        config = hf.read_config(root, field=field)
        cfg = hf.model_config(config)
    else:
        try:
            meta = jsonio.loads((root / EXPORT_META).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(field, f"cannot read {root / EXPORT_META}: {err}") from None
        cfg = recorded_config({"model": meta.get("model", {})}, root / EXPORT_META, field, trust_plugin).model
    graphdef, abstract = abstract_model(cfg)
    layout = inference_layout(cfg, mesh, rules, abstract)
    shardings = named_shardings(layout.param_specs(), mesh)
    if kind is SourceKind.HF:
        files = hf.SafetensorsFiles(root, field=field)
        params = hf.load_params(files, hf.adapter_of(family_of(cfg), field=field), cfg, abstract, shardings,
                                field=field)
        return LoadedModel(cfg, graphdef, params, mesh, layout.rules, kind, root, config, hf.tensor_dtypes(files),
                           home=root, trained_on_bytes=False)
    target = check_params(str(root), abstract, shardings, model_config=model_dict(cfg), field=field)
    nnx.replace_by_pure_dict(abstract, load_params(str(root), target, field=field))  # filled in place
    source_hf = meta.get("hf", {})
    return LoadedModel(cfg, graphdef, abstract, mesh, layout.rules, kind, root, source_hf.get("config"),
                       source_hf.get("dtypes"), home=root, trained_on_bytes=_trained_on_bytes(meta.get("config")))


def _trained_on_bytes(config: dict | None) -> bool | None:
    """Whether a run's config trained on UTF-8 bytes (``data.source: text``); None when unrecorded."""
    data = (config or {}).get("data")
    return None if not isinstance(data, dict) else data.get("source") == "text"


def _hf_source_config(cfg: Config) -> dict | None:
    """The ``config.json`` a run fine-tuned from (``checkpoint.init_from=hf:DIR``), so that an export
    keeps what the run did not change (``max_position_embeddings``, token ids); None otherwise."""
    init_from = cfg.checkpoint.init_from
    if init_from is None or not init_from.startswith(hf.INIT_PREFIX):
        return None
    source = pathlib.Path(init_from.removeprefix(hf.INIT_PREFIX))
    try:
        return hf.read_config(source)
    except ConfigError:
        log(f"warning: the Hugging Face checkpoint this run started from ({source}) is gone; an export gets "
            f"max_position_embeddings from the run's seq_len ({cfg.model.seq_len})")
        return None


def recorded_config(raw: dict, source: pathlib.Path, field: str, trust_plugin: bool) -> Config:
    """The config recorded in file ``source`` (a checkpoint's or an export's metadata: data a user
    may have downloaded), its ``model.plugin`` imported only with ``trust_plugin``."""
    try:
        return config_from_dict(raw, trust_plugin=trust_plugin)
    except UntrustedPlugin as err:
        raise ConfigError(field, f"{source}: {err.message}") from None


def restore_run(path: str | pathlib.Path, mesh: Mesh, rules: ShardingRules | None = None, *,
                step: int | None = None, field: str = "--run",
                trust_plugin: bool = False) -> tuple[Config, ShardedState, Restored]:
    """(the run's config, its state laid out on ``mesh`` under ``rules`` (default: the run's own) by
    the run's model, train and optimizer sections, its checkpoint ``step`` (default: the latest complete
    one) restored into that state's shardings with the layers in model order). A ``model.plugin`` the
    run records is imported only with ``trust_plugin``."""
    checkpoints, given_step = resolve_restore_path(str(path), field=field)
    source = RunCheckpoints(checkpoints, read_only=True)
    try:
        step = source.pick_step(step, given_step)
        try:
            cfg = recorded_config(source.read_meta(step)["config"], source.path(step), field, trust_plugin)
        except UnreadableCheckpoint as err:
            raise ConfigError(field, f"checkpoint {source.path(step)} is unreadable ({err}); pass --step to "
                              f"load another of {source.steps()}") from None
        sharded = ShardedState(Layout.of(cfg.model, mesh.shape, rules or cfg.sharding.resolve(), cfg.train), mesh,
                               cfg.optimizer)
        try:
            restored = source.restore(step, sharded.abstract_state(), field=field,
                                      layer_order=LayerOrder(num_layers=cfg.model.num_layers))
        except UnreadableCheckpoint as err:
            raise ConfigError(field, f"checkpoint {source.path(step)} is unreadable ({err}); pass --step to "
                              f"load another of {source.steps()}") from None
    finally:
        source.close()
    return cfg, sharded, restored


def mesh_and_rules(overrides: list[str]) -> tuple[Mesh, ShardingRules]:
    """The mesh and rules of ``mesh.*=`` / ``sharding.*=`` overrides (default: fsdp over all devices)."""
    for text in overrides:
        section = text.split("=", 1)[0].split(".", 1)[0]
        if section not in ("mesh", "sharding"):
            raise ConfigError(text.split("=", 1)[0], "only mesh.* and sharding.* overrides are accepted here")
    cfg = load_config(None, overrides)
    return make_mesh(cfg.mesh), cfg.sharding.resolve()


def mesh_from_args(args: argparse.Namespace) -> tuple[Mesh, ShardingRules]:
    """The tools' mesh: starts JAX on ``--host-devices`` when given (``cli.add_mesh_arguments``), then
    the mesh and rules of the ``mesh.*=`` / ``sharding.*=`` overrides."""
    if args.host_devices is not None:
        use_host_devices(args.host_devices)
    return mesh_and_rules(args.overrides)
