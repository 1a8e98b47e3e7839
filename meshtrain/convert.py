"""``python -m meshtrain.convert from-hf --hf DIR --out DIR`` and ``to-hf --from DIR --out DIR``

``from-hf`` imports a Hugging Face Llama-family checkpoint (``config.json`` + safetensors) into a
meshtrain parameter export (``DIR/params`` + ``DIR/meshtrain.json``, as ``python -m
meshtrain.export`` writes; fine-tune with ``checkpoint.init_from=DIR``, or skip this step with
``checkpoint.init_from=hf:HF_DIR``). ``to-hf`` writes a run directory, a step directory or an export
as an HF checkpoint that ``transformers.LlamaForCausalLM.from_pretrained`` loads.

Options::

    from-hf --hf DIR --out DIR [--host-devices N] [mesh.*=... sharding.preset=...]
    to-hf --from DIR --out DIR [--step N] [--dtype auto|float32|bfloat16|float16]
          [--max-shard-size 5GB] [--host-devices N] [mesh.*=... sharding.preset=...]

The weights are read straight into the shardings of the mesh (default: ``fsdp`` over every
device). Bad input prints one ``error: field: what is wrong`` line and exits 2.
``load_model`` is the loader that ``meshtrain.logits`` and ``meshtrain.generate`` share.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import pathlib
import re
import shutil
import sys
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshtrain import hf
from meshtrain.checkpoint import (CHECKPOINT_DIR, EXPORT_META, PARAMS_DIR, RunCheckpoints,
                                  UnreadableCheckpoint, check_params, load_params, resolve_restore_path,
                                  save_params)
from meshtrain.config import config_from_dict, load_config, to_dict
from meshtrain.errors import ConfigError
from meshtrain.mesh import make_mesh
from meshtrain.parallel.pipeline import LayerOrder
from meshtrain.parallel.rules import ShardingRules
from meshtrain.parallel.sharding import activation_sharding, param_shardings
from meshtrain.cli import ArgumentParser, run, use_host_devices
from meshtrain.train import stored_layer_order
from models.common import ActivationSharding
from models.llama import Llama, LlamaConfig


class SourceKind(str, enum.Enum):
    HF = "hf"  # config.json + safetensors
    EXPORT = "export"  # params/ + meshtrain.json (python -m meshtrain.export, convert from-hf)
    RUN = "run"  # a run directory, its checkpoints/ or one step directory


@dataclasses.dataclass
class LoadedModel:
    """A model's config and parameters (fp32, in their shardings on ``mesh``), ready to run."""

    cfg: LlamaConfig
    graphdef: Any
    params: nnx.State
    mesh: Mesh
    rules: ShardingRules
    kind: SourceKind
    path: pathlib.Path
    hf_config: dict | None = None  # the config.json an HF model (or an import of one) came with
    hf_dtypes: dict[str, str] | None = None  # its tensors' dtypes

    @property
    def shard(self) -> ActivationSharding:
        return activation_sharding(self.rules, self.mesh)

    def module(self) -> Llama:
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


def abstract_model(cfg: LlamaConfig) -> tuple[Any, nnx.State]:
    """(graphdef, abstract params with logical axes) of ``cfg``, allocating nothing."""
    return nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))


def load_hf(path: str | pathlib.Path, abstract_params: nnx.State, shardings: nnx.State, *,
            storage_of_logical: np.ndarray | None = None, field: str) -> tuple[nnx.State, hf.SafetensorsFiles]:
    """HF weights at ``path`` read straight into ``shardings``."""
    files = hf.SafetensorsFiles(path, field=field)
    return hf.load_params(files, abstract_params, shardings, storage_of_logical=storage_of_logical,
                          field=field), files


def load_model(path: str | pathlib.Path, mesh: Mesh, rules: ShardingRules, *, step: int | None = None,
               field: str = "--model") -> LoadedModel:
    """The model at ``path`` (an HF directory, a meshtrain export or a run) on ``mesh``.

    Each device reads only its own shards. A run's checkpoint (the latest, or ``step``) is restored
    in full (parameters and optimizer moments) and its layers put back in model order.
    """
    if mesh.shape["stage"] != 1:
        raise ConfigError("mesh.stage", f"is {mesh.shape['stage']}; loading for inference or conversion "
                          "uses no pipeline stages (use 1)")
    root = pathlib.Path(path)
    kind = source_kind(root, field=field)
    if kind is SourceKind.HF:
        config = hf.read_config(root, field=field)
        cfg = hf.llama_config(config)
        graphdef, abstract = abstract_model(cfg)
        params, files = load_hf(root, abstract, param_shardings(abstract, rules, mesh), field=field)
        return LoadedModel(cfg, graphdef, params, mesh, rules, kind, root, config, hf.tensor_dtypes(files))
    if kind is SourceKind.EXPORT:
        try:
            meta = json.loads((root / EXPORT_META).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(field, f"cannot read {root / EXPORT_META}: {err}") from None
        cfg = config_from_dict({"model": meta.get("model", {})}).model
        graphdef, abstract = abstract_model(cfg)
        target = check_params(str(root), abstract, param_shardings(abstract, rules, mesh),
                              model_config=to_dict(cfg), field=field)
        params = abstract  # a fresh tree of its own: filled in place
        nnx.replace_by_pure_dict(params, load_params(str(root), target, field=field))
        source_hf = meta.get("hf", {})
        return LoadedModel(cfg, graphdef, params, mesh, rules, kind, root, source_hf.get("config"),
                           source_hf.get("dtypes"))
    return _load_run(root, mesh, rules, step, field)


def _load_run(root: pathlib.Path, mesh: Mesh, rules: ShardingRules, step: int | None,
              field: str) -> LoadedModel:
    from meshtrain.trainer import Trainer

    checkpoints, given_step = resolve_restore_path(str(root), field=field)
    source = RunCheckpoints(checkpoints, read_only=True)
    try:
        step = source.pick_step(step, given_step)
        try:
            meta = source.read_meta(step)
            cfg = config_from_dict(meta["config"])
        except UnreadableCheckpoint as err:
            raise ConfigError(field, f"checkpoint {source.path(step)} is unreadable ({err})") from None
        # The trainer only gives the state's shapes here: any batch size it accepts will do.
        train_cfg = dataclasses.replace(cfg.train, batch_size=mesh.devices.size, grad_accum=1)
        trainer = Trainer(cfg.model, train_cfg, cfg.optimizer, rules, mesh)
        try:
            restored = source.restore(step, trainer.abstract_state(), field=field, config=to_dict(cfg))
        except UnreadableCheckpoint as err:
            raise ConfigError(field, f"checkpoint {source.path(step)} is unreadable ({err})") from None
    finally:
        source.close()
    params = stored_layer_order(meta).convert(restored.state.params, LayerOrder(num_layers=cfg.model.num_layers))
    del restored
    return LoadedModel(cfg.model, trainer.graphdef, params, mesh, rules, SourceKind.RUN,
                       source.path(step))


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host-devices N`` and ``mesh.*=`` / ``sharding.*=`` overrides (see ``mesh_from_args``)."""
    parser.add_argument("--host-devices", type=int, metavar="N", help="simulate N CPU devices")
    parser.add_argument("overrides", nargs="*", metavar="mesh.*=value")


def mesh_from_args(args: argparse.Namespace) -> tuple[Mesh, ShardingRules]:
    """Starts JAX on ``--host-devices`` when given, then the mesh and rules of the overrides."""
    if args.host_devices is not None:
        use_host_devices(args.host_devices)
    return mesh_and_rules(args.overrides)


def mesh_and_rules(overrides: list[str]) -> tuple[Mesh, ShardingRules]:
    """The mesh and rules of ``mesh.*=`` / ``sharding.*=`` overrides (default: fsdp over all devices)."""
    for text in overrides:
        section = text.split("=", 1)[0].split(".", 1)[0]
        if section not in ("mesh", "sharding"):
            raise ConfigError(text.split("=", 1)[0], "only mesh.* and sharding.* overrides are accepted here")
    cfg = load_config(None, overrides)
    return make_mesh(cfg.mesh), cfg.sharding.resolve()


def _new_dir(path: str, field: str = "--out") -> pathlib.Path:
    out = pathlib.Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(field, f"{path} exists and is not empty; choose a new directory")
    return out


def _copy_side_files(source: pathlib.Path, out: pathlib.Path) -> list[str]:
    copied = []
    if source.is_dir() and jax.process_index() == 0:
        for name in hf.SIDE_FILES:
            if (source / name).is_file():
                out.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source / name, out / name)
                copied.append(name)
    return copied


def from_hf(hf_dir: str, out: str, mesh: Mesh, rules: ShardingRules) -> pathlib.Path:
    """Imports the HF checkpoint ``hf_dir`` into a meshtrain export at ``out``."""
    out_dir = _new_dir(out)
    if source_kind(hf_dir, field="--hf") is not SourceKind.HF:
        raise ConfigError("--hf", f"{hf_dir} has no {hf.CONFIG_FILE}; give a Hugging Face model directory")
    model = load_model(hf_dir, mesh, rules, field="--hf")
    meta = {"source": str(pathlib.Path(hf_dir).absolute()), "model": to_dict(model.cfg),
            "hf": {"config": model.hf_config, "dtypes": model.hf_dtypes}}
    written = save_params(out_dir, model.params, meta)
    _copy_side_files(pathlib.Path(hf_dir), written)
    return written


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}


def parse_size(text: str, field: str = "--max-shard-size") -> int:
    """``"5GB"`` -> 5_000_000_000 (B, KB, MB, GB, KiB, MiB, GiB; a bare number is bytes)."""
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(field, f"{text!r} is not a size; write e.g. 5GB, 500MB or 1048576")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def to_hf(source: str, out: str, mesh: Mesh, rules: ShardingRules, *, step: int | None = None,
          dtype: str = "auto", max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Writes the model at ``source`` (run, step directory, export or HF directory) as an HF
    checkpoint at ``out``. ``dtype`` ``auto`` keeps an import's own tensor dtypes, else float32."""
    if dtype != "auto" and dtype not in hf.DTYPES:
        raise ConfigError("--dtype", f"{dtype!r} is not valid; use auto or one of {list(hf.DTYPES)}")
    out_dir = _new_dir(out)
    model = load_model(source, mesh, rules, step=step, field="--from")
    if dtype == "auto":
        recorded = model.hf_dtypes or {}
        file_dtype = lambda name: recorded.get(name, "float32")
    else:
        file_dtype = dtype
    written = hf.save(out_dir, model.cfg, model.params, dtype=file_dtype, base_config=model.hf_config,
                      max_shard_bytes=max_shard_bytes)
    return written + _copy_side_files(model.path, out_dir)


def _parse_args(argv: list[str] | None):
    parser = ArgumentParser(prog="python -m meshtrain.convert", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    importer = commands.add_parser("from-hf", help="HF checkpoint -> meshtrain export")
    importer.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    exporter = commands.add_parser("to-hf", help="meshtrain run or export -> HF checkpoint")
    exporter.add_argument("--from", dest="source", required=True,
                          help="run directory, step directory, export or HF directory")
    exporter.add_argument("--step", type=int, help="checkpoint step of a run (default: the latest)")
    exporter.add_argument("--dtype", default="auto", help="auto (an import's own dtypes, else float32), "
                          "float32, bfloat16 or float16")
    exporter.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    for command in (importer, exporter):
        command.add_argument("--out", required=True, help="new directory to write")
        add_mesh_arguments(command)
    return parser.parse_args(argv)


def _convert(argv: list[str] | None) -> None:
    args = _parse_args(argv)
    mesh, rules = mesh_from_args(args)
    if args.command == "from-hf":
        written = from_hf(args.hf, args.out, mesh, rules)
        message = (f"imported {args.hf} to {written}; fine-tune with checkpoint.init_from={written} "
                   f"(or checkpoint.init_from={hf.INIT_PREFIX}{args.hf})")
    else:
        files = to_hf(args.source, args.out, mesh, rules, step=args.step, dtype=args.dtype,
                      max_shard_bytes=parse_size(args.max_shard_size))
        message = f"wrote {args.out}: {', '.join(files)}"
    if jax.process_index() == 0:
        print(message, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    return run(_convert, argv)


if __name__ == "__main__":
    sys.exit(main())
