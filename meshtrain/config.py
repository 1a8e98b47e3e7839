"""The run configuration: one typed section per component, loaded from YAML plus CLI overrides.

Sections and their owners::

    mesh       meshtrain.mesh.MeshConfig
    sharding   meshtrain.parallel.rules.ShardingConfig
    model      the model family's config class (``model.family``, default ``llama``; ``model.plugin``
               names a module to import that registers more families, or its ``.py`` file, which
               a config file names relative to its own directory: ``models/api.py``)
    optimizer  meshtrain.optim.OptimizerConfig
    data       meshtrain.data.DataConfig
    train      meshtrain.train_config.TrainConfig
    pipeline   meshtrain.parallel.pipeline.PipelineConfig
    zero       meshtrain.parallel.zero.ZeroConfig
    offload    meshtrain.parallel.offload.OffloadConfig
    run        meshtrain.config.RunConfig
    checkpoint meshtrain.checkpoint.CheckpointConfig
    eval       meshtrain.evaluation.EvalConfig
    distributed meshtrain.distributed.DistributedConfig

An override ``a.b=value`` parses ``value`` as YAML (``mesh.data=2``, ``train.precision=bf16``,
``sharding.rules.vocab={params: null, activations: tensor}``) and replaces ``a.b``.

A YAML file may name another with a top-level ``base: FILE`` (relative to its own directory, or
absolute): the chain of bases is read first, each file merged over the one it names (mappings
merge key by key at every depth, anything else replaces the base's value whole), then the
overrides. ``resolve_config`` also returns where each value came from, which ``annotated_yaml``
prints as a comment beside it (``python -m meshtrain.train --print-config``).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import pathlib
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

import dacite
import yaml

from meshtrain import yamlio
from meshtrain.checkpoint import CheckpointConfig
from meshtrain.cli import TRUST_PLUGIN_FLAG
from meshtrain.data import DataConfig
from meshtrain.distributed import DistributedConfig
from meshtrain.errors import ConfigError, cut, shown
from meshtrain.evaluation import EvalConfig
from meshtrain.mesh import MeshConfig
from meshtrain.optim import OptimizerConfig
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.offload import OffloadConfig
from meshtrain.parallel.pipeline import PipelineConfig
from meshtrain.parallel.rules import ShardingConfig
from meshtrain.parallel.zero import ZeroConfig
from meshtrain.trackers import Logger
from meshtrain.train_config import TrainConfig
from meshtrain.weights import hf
from models.api import (DEFAULT_FAMILY, UnknownFamily, families, family_named, family_of, import_plugin,
                        is_plugin_file, plugin_imported, plugin_of)
from models.common import InvalidField

INT_LIMIT = 2 ** 63  # what numpy and JAX accept as a Python int (seeds, counts, sizes)
# The model section's own fields (from_hf=DIR: the model of DIR/config.json); the rest are the family config's.
FAMILY_FIELD, PLUGIN_FIELD, FROM_HF_FIELD = "family", "plugin", "from_hf"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where a run writes (``dir`` holds metrics.jsonl, tensorboard/, summary.json, loss.png) and the
    experiment trackers its metrics also go to (``meshtrain.trackers``)."""

    dir: str = "runs/default"
    loggers: tuple[Logger, ...] = (Logger.TENSORBOARD,)  # any of tensorboard, wandb, mlflow; [] for none
    project: str | None = None  # the W&B project and MLflow experiment (None: their env variables, else meshtrain)
    name: str | None = None  # the tracked run's name (None: dir's last component)

    def __post_init__(self):
        if not self.dir:
            raise ConfigError("dir", "must be a non-empty path")
        valid = " | ".join(logger.value for logger in Logger)
        loggers = []
        for value in self.loggers:
            try:
                loggers.append(Logger(value))
            except ValueError:
                raise ConfigError("loggers", f"{shown(value)} is not valid{_suggest(str(value), valid.split(' | '))}; "
                                  f"use any of {valid}") from None
        if len(set(loggers)) < len(loggers):
            raise ConfigError("loggers", f"names a logger twice: {[logger.value for logger in loggers]}")
        object.__setattr__(self, "loggers", tuple(loggers))
        for field in ("project", "name"):
            if getattr(self, field) == "":
                raise ConfigError(field, "must be a non-empty name, or null for the default")


@dataclasses.dataclass(frozen=True)
class Config:
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    model: Any = dataclasses.field(default_factory=lambda: family_named(DEFAULT_FAMILY).config_class())
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    zero: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def layout(self, mesh_shape: Mapping[str, int], abstract_params: Any = None) -> Layout:
        """The ``Layout`` of this config on a mesh of ``mesh_shape`` ({data, fsdp, tensor, stage})."""
        return Layout.of(self.model, mesh_shape, self.sharding.resolve(), self.train, self.pipeline, self.zero,
                         self.offload, abstract_params=abstract_params)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)
_DACITE = dacite.Config(strict=True, cast=[enum.Enum, tuple, float])
# Other spellings accepted, stored where their owner reads them: ``model.init_from``
# (where the model's weights come from) is read by the checkpoint component.
_ALIASES = {("model", "init_from"): ("checkpoint", "init_from")}


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _set_dotted(raw: dict, dotted: str, value: Any, sources: dict | None = None) -> None:
    """Sets ``raw[a][b]... = value`` for ``dotted`` ``"a.b..."``; ``sources`` (the provenance tree
    mirroring ``raw``, see ``resolve_config``) records the value as the command line's."""
    keys = dotted.split(".")
    node, origin = raw, sources if sources is not None else {}
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(keys[:depth + 1]), f"is a value, not a section; cannot set {dotted}")
        node = child
        if not isinstance(origin.get(key), dict):
            origin[key] = {}
        origin = origin[key]
    node[keys[-1]] = value
    origin[keys[-1]] = _labelled(value, FROM_COMMAND_LINE)


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.steps=10"`` -> ``("train.steps", 10)`` (the value is parsed as YAML)."""
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(text, "an override must look like section.field=value, e.g. train.steps=100")
    try:
        return key, yamlio.loads(value) if value else ""
    except yaml.YAMLError as err:
        raise ConfigError(key, f"cannot parse value {shown(value)} as YAML: {yamlio.problem(err)}") from None
    except yamlio.Refused as err:
        raise ConfigError(key, f"value {shown(value)} is refused: {err}") from None
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise ConfigError(key, f"cannot parse value {shown(value)}: {cut(str(err))}") from None


def _check_fields(path: str, cls: type, raw: dict) -> None:
    """Rejects, naming the full dotted path, what dacite would report vaguely or accept silently:
    unknown fields at any depth, non-mappings where a section is expected, booleans given for
    int/float fields (bool is an int to dacite), non-numbers for float fields (dacite's float()
    cast fails naming only the section), non-finite floats (nan, inf) and a bare string or a mapping
    for a list (dacite splits the one into characters and iterates the other's keys)."""
    valid = [field.name for field in dataclasses.fields(cls)]
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        field = f"{path}.{key}"
        if key not in valid:
            raise ConfigError(field, f"unknown field{_suggest(str(key), valid)}; valid: {valid}")
        hint = hints[key]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if hint in (int, float) and isinstance(value, bool):
            raise ConfigError(field, f"expected {hint.__name__}, got {shown(value)}")
        if int in (hint, *args) and isinstance(value, int) and not isinstance(value, bool) \
                and not -INT_LIMIT <= value < INT_LIMIT:
            raise ConfigError(field, f"{shown(value, 40)} is out of range; must be below 2**63")
        if hint is float and not _is_float(value):  # dacite casts with float(), naming no field
            raise ConfigError(field, f"expected float, got {shown(value)}")
        if float in (hint, *args) and _is_float(value) and not isinstance(value, bool) \
                and not math.isfinite(float(value)):  # nan passes both `> 0` and `< 0` checks
            raise ConfigError(field, f"must be a finite number, got {shown(value)}")
        if origin is tuple and isinstance(value, str):
            raise ConfigError(field, f"expected a list, got the string {shown(value)}; write [{shown(value)[1:-1]}]")
        if origin is tuple and isinstance(value, dict):  # dacite would iterate its keys
            raise ConfigError(field, f"expected a list, got the mapping {shown(value)}; write a list of entries, "
                              "e.g. [{path: DIR, weight: 1.0}]" if args and dataclasses.is_dataclass(args[0])
                              else f"expected a list, got the mapping {shown(value)}")
        if dataclasses.is_dataclass(hint):
            _check_mapping(field, hint, value)
        elif origin is tuple and args and dataclasses.is_dataclass(args[0]) and isinstance(value, list):
            for i, item in enumerate(value):
                _check_mapping(f"{field}[{i}]", args[0], item)
        elif origin is dict and isinstance(value, dict) and dataclasses.is_dataclass(args[1]):
            for name, item in value.items():
                _check_mapping(f"{field}.{name}", args[1], item)


def _is_float(value: Any) -> bool:
    """Whether dacite's float cast accepts ``value`` (YAML 1.1 reads ``3e-4`` as a string)."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return isinstance(value, (int, float))


def _check_mapping(path: str, cls: type, value: Any) -> None:
    if not isinstance(value, dict):
        fields = [field.name for field in dataclasses.fields(cls)]
        raise ConfigError(path, f"must be a mapping with fields {fields}, got {shown(value)}")
    _check_fields(path, cls, value)


def _section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(name, f"must be a mapping of fields, got {shown(raw)}")
    _check_fields(name, cls, raw)
    try:
        return dacite.from_dict(cls, raw, config=_DACITE)
    except (ConfigError, InvalidField) as err:
        raise ConfigError(f"{name}.{err.field}", err.message) from None
    except dacite.WrongTypeError as err:
        raise ConfigError(f"{name}.{err.field_path}", f"expected {_type_name(err.field_type)}, "
                          f"got {shown(err.value)}") from None
    except dacite.UnexpectedDataError as err:
        raise ConfigError(f"{name}.{sorted(err.keys)[0]}", "unknown field") from None
    except dacite.DaciteFieldError as err:
        raise ConfigError(f"{name}.{err.field_path}", str(err).split(": ", 1)[-1]) from None
    except (ValueError, TypeError) as err:
        field, message = _invalid_enum(cls, raw) or ("", str(err))
        raise ConfigError(f"{name}.{field}".rstrip("."), message) from None


def _type_name(field_type: Any) -> str:
    if isinstance(field_type, type) and issubclass(field_type, enum.Enum):
        return "one of " + " | ".join(str(member.value) for member in field_type)
    if typing.get_origin(field_type) is not None:  # tuple[str, ...] rather than tuple
        return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", str(field_type))
    return getattr(field_type, "__name__", str(field_type))


def _invalid_enum(cls: type, raw: dict) -> tuple[str, str] | None:
    """(field, message) for the enum field whose value is not one of its members."""
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        field_type = hints[key]
        options = [arg for arg in typing.get_args(field_type) if arg is not type(None)]
        if typing.get_origin(field_type) in (typing.Union, types.UnionType) and len(options) == 1:
            field_type = options[0]  # an optional field (train.fp8.matmuls: a list or null)
        if (isinstance(field_type, type) and issubclass(field_type, enum.Enum)
                and value not in [member.value for member in field_type]):
            return key, f"{shown(value)} is not valid; use {_type_name(field_type)}"
        items = typing.get_args(field_type)[:1]  # a list of enum members (run.loggers)
        if (typing.get_origin(field_type) is tuple and items and isinstance(items[0], type)
                and issubclass(items[0], enum.Enum) and isinstance(value, list)):
            members = [str(member.value) for member in items[0]]
            for item in value:
                if item not in members:
                    return key, (f"{shown(item)} is not valid{_suggest(str(item), members)}; use any of "
                                 f"{' | '.join(members)}")
        if dataclasses.is_dataclass(field_type) and isinstance(value, dict):  # a nested section (train.fp8)
            known = typing.get_type_hints(field_type)
            found = _invalid_enum(field_type, {k: v for k, v in value.items() if k in known})
            if found:
                return f"{key}.{found[0]}", found[1]
    return None


BASE_FIELD = "base"
# The comments ``annotated_yaml`` prints beside each value: where it came from.
FROM_COMMAND_LINE, DEFAULT = "from the command line", "default"


def load_config(path: str | pathlib.Path | None, overrides: list[str] = ()) -> Config:
    """Reads YAML ``path`` (or defaults when None) and the chain of files its ``base:`` names,
    applies ``overrides``, validates every section."""
    return resolve_config(path, overrides)[0]


def resolve_config(path: str | pathlib.Path | None, overrides: list[str] = ()) -> tuple[Config, dict]:
    """``load_config``'s config and where each value came from: a tree mirroring the raw mapping
    whose leaves are ``"from FILE"`` or ``FROM_COMMAND_LINE`` (a field it lacks is a default)."""
    raw, sources = _read_chain(pathlib.Path(path)) if path is not None else ({}, {})
    parsed = [parse_override(text) for text in overrides]  # model.from_hf first: the other overrides win
    raw, sources = _with_hf_model(raw, sources, {"model": {k[6:]: v for k, v in parsed if k[:6] == "model."}})
    for key, value in parsed:
        if key == f"model.{FROM_HF_FIELD}":
            continue
        if key.split(".")[0] == BASE_FIELD:
            raise ConfigError(BASE_FIELD, f"names a base config inside a YAML file ({BASE_FIELD}: FILE), "
                              "not as an override")
        _set_dotted(raw, key, value, sources)
    for (section, field), (owner, owned) in _ALIASES.items():  # the value is printed where it is stored
        if isinstance(sources.get(section), dict) and field in sources[section]:
            origin = sources[section].pop(field)
            if not isinstance(sources.get(owner), dict):
                sources[owner] = {}
            sources[owner][owned] = origin
    run_sources = sources.get("run")
    if isinstance(run_sources, dict) and TENSORBOARD_FIELD in run_sources:  # printed as the run.loggers it sets
        origin = run_sources.pop(TENSORBOARD_FIELD)
        run_sources.setdefault("loggers", origin)
    return config_from_dict(raw, trust_plugin=True), sources


def _read_chain(path: pathlib.Path) -> tuple[dict, dict]:
    """The raw mapping of ``path`` merged over its chain of bases, and its provenance tree."""
    layers: list[tuple[str, dict]] = []  # (the file as the user named it, its mapping), the named file first
    label, field, where = str(path), "--config", ""
    seen: dict[pathlib.Path, str] = {}
    while True:
        try:
            identity = path.resolve()
        except (OSError, RuntimeError):  # a symlink loop: reading it fails below, naming the file
            identity = path.absolute()
        if identity in seen:
            chain = " -> ".join([*seen.values(), label])
            raise ConfigError(BASE_FIELD, f"the base files form a cycle: {chain}; remove one of their "
                              f"{BASE_FIELD}: keys")
        seen[identity] = label
        raw = _read_mapping(path, label, field, where)
        _plugin_file_from(raw, path.parent)
        layers.append((label, raw))
        if BASE_FIELD not in raw:
            break
        base = raw.pop(BASE_FIELD)
        if not isinstance(base, str) or not base:
            raise ConfigError(BASE_FIELD, f"must be the path of a YAML config file (relative to the "
                              f"directory of {label}, or absolute), got {shown(base)} in {label}")
        where = f" (the {BASE_FIELD} named in {label})"
        path, label, field = path.parent / base, os.path.normpath(pathlib.Path(label).parent / base), BASE_FIELD
    raw, sources = {}, {}
    for label, layer in reversed(layers):
        raw, sources = _merged(*_with_hf_model(raw, sources, layer), layer, f"from {label}", sections=True)
    return raw, sources


def _with_hf_model(raw: dict, sources: dict, layer: dict) -> tuple[dict, dict]:
    """``raw`` and its provenance under ``layer`` (a config's mapping, merged over them next) that sets
    ``model.from_hf: DIR`` (taken out of it): the model of ``DIR/config.json`` (its family's HF adapter), the
    fields of ``raw``'s model that do not describe the architecture (``HFAdapter.architecture_fields``) over it."""
    model, field = layer.get("model"), f"model.{FROM_HF_FIELD}"
    if not isinstance(model, dict) or FROM_HF_FIELD not in model:
        return raw, sources
    directory = model.pop(FROM_HF_FIELD)
    if not isinstance(directory, str) or not directory or not pathlib.Path(directory).is_dir():
        raise ConfigError(field, f"{shown(directory)} is not a directory; give a Hugging Face model directory")
    try:
        hf_model = hf.model_config(hf.read_config(directory, field=field))
    except ConfigError as err:  # read_config's names the field, model_config's a config.json key
        where = "" if err.field == field else f"{directory}/{err.field}: "
        raise ConfigError(field, where + err.message) from None
    ours = model_dict(hf_model)
    if model.get(FAMILY_FIELD, ours[FAMILY_FIELD]) != ours[FAMILY_FIELD]:
        raise ConfigError(field, f"{directory} holds a model of family {ours[FAMILY_FIELD]!r}, not model.family "
                          f"{model[FAMILY_FIELD]!r}; drop model.family (from_hf sets it)")
    architecture = (FAMILY_FIELD, PLUGIN_FIELD, *family_of(hf_model).hf.architecture_fields)
    kept = lambda part: {k: v for k, v in part.items() if (k in ours and k not in architecture)
                         or ("model", k) in _ALIASES} if isinstance(part, dict) else {}
    origin = f"from {directory}/{hf.CONFIG_FILE}"
    return ({**raw, "model": {**ours, **kept(raw.get("model"))}},
            {**sources, "model": {**_labelled(ours, origin), **kept(sources.get("model"))}})


def _plugin_file_from(raw: dict, directory: pathlib.Path) -> None:
    """Makes a relative ``model.plugin`` file path in ``raw`` (a config file's mapping) absolute,
    relative to ``directory`` (the file's): the plugin file lives beside its config, wherever the
    command runs from. A module name, or a path from the command line, is left as it is."""
    model = raw.get("model")
    plugin = model.get(PLUGIN_FIELD) if isinstance(model, dict) else None
    if isinstance(plugin, str) and is_plugin_file(plugin) and not os.path.isabs(plugin):
        model[PLUGIN_FIELD] = os.path.abspath(directory / plugin)


def _read_mapping(path: pathlib.Path, label: str, field: str, where: str) -> dict:
    """The YAML mapping in file ``path``; an error names ``field``, the file as ``label`` and ends
    with ``where``."""
    if path.is_dir():
        raise ConfigError(field, f"{label} is a directory; give a YAML config file{where}")
    if path.exists() and not path.is_file():  # reading a FIFO would wait for a writer
        raise ConfigError(field, f"{label} is not a regular file (a device, FIFO or socket); give a YAML config "
                          f"file{where}")
    if not path.is_file():
        raise ConfigError(field, f"no such file: {label}{where}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:  # a binary file
        raise ConfigError(field, f"{label} is not a UTF-8 text file (byte {err.start}){where}") from None
    except OSError as err:
        raise ConfigError(field, f"cannot read {label}: {err.strerror or err}{where}") from None
    try:
        raw = yamlio.loads(text) or {}  # an empty file: no fields
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise ConfigError(field, f"{label} is not valid YAML: {cut(str(err))}{where}") from None
    except yaml.YAMLError as err:
        raise ConfigError(field, f"{label} is not valid YAML: {yamlio.problem(err)}{where}") from None
    except yamlio.Refused as err:
        raise ConfigError(field, f"{label} is refused: {err}{where}") from None
    if not isinstance(raw, dict):
        raise ConfigError(field, f"{label} must hold a mapping of sections {list(SECTIONS)}{where}")
    return raw


def _labelled(value: Any, origin: str) -> Any:
    """The provenance tree of ``value``: ``origin`` at each leaf (a non-mapping or empty mapping)."""
    if isinstance(value, dict) and value:
        return {key: _labelled(item, origin) for key, item in value.items()}
    return origin


def _merged(base: dict, sources: dict, child: dict, origin: str, sections: bool = False) -> tuple[dict, dict]:
    """``child`` (from ``origin``) merged over ``base`` (whose provenance tree is ``sources``):
    a mapping over a mapping merges key by key, anything else replaces the base's value whole.
    At the top level (``sections``) a section left empty (``train:``, read as None) keeps the
    base's, as it would keep the defaults."""
    base, sources = dict(base), dict(sources)
    for key, value in child.items():
        below = base.get(key)
        if isinstance(below, dict) and (isinstance(value, dict) or (sections and value is None)):
            if value and below:
                base[key], sources[key] = _merged(below, sources[key], value, origin)
            elif value:
                base[key], sources[key] = value, _labelled(value, origin)
            continue  # an empty mapping keeps the base's
        base[key], sources[key] = value, _labelled(value, origin)
    return base, sources


# run.tensorboard (a bool) came before run.loggers; configs and checkpoints written then still load.
TENSORBOARD_FIELD = "tensorboard"


def _tensorboard_alias(raw: dict) -> dict:
    """``raw`` with the deprecated ``run.tensorboard`` turned into ``run.loggers``: ``false`` is
    ``run.loggers: []``, ``true`` the default (``[tensorboard]``). Given beside ``run.loggers``, it
    must agree with it (a base file's ``tensorboard: false`` under an override ``run.loggers=[wandb]``)."""
    run = raw.get("run")
    if not isinstance(run, dict) or TENSORBOARD_FIELD not in run:
        return raw
    value, rest = run[TENSORBOARD_FIELD], {k: v for k, v in run.items() if k != TENSORBOARD_FIELD}
    if not isinstance(value, bool):
        raise ConfigError("run.tensorboard", f"expected true or false, got {shown(value)}; it is deprecated: "
                          "write run.loggers: [tensorboard] (the default) or run.loggers: []")
    loggers = rest.get("loggers")
    if isinstance(loggers, list) and (Logger.TENSORBOARD.value in loggers) != value:
        raise ConfigError("run.tensorboard", f"{str(value).lower()} contradicts run.loggers {shown(loggers)}; "
                          "drop run.tensorboard (deprecated): run.loggers alone names the loggers")
    if "loggers" not in rest and not value:
        rest["loggers"] = []
    return {**raw, "run": rest}


def config_from_dict(raw: dict, *, trust_plugin: bool) -> Config:
    """Validates a raw ``{section: {field: value}}`` mapping (YAML, a checkpoint's saved config).

    ``trust_plugin``: whether a ``model.plugin`` it names may be imported (run). A config the user
    gave is trusted; one recorded in a file they may have downloaded (a run's checkpoint, an
    export) only with the tools' ``--trust-plugin`` (``UntrustedPlugin`` otherwise)."""
    raw = _tensorboard_alias(raw)
    for (section, field), (owner, owned) in _ALIASES.items():
        if isinstance(raw.get(section), dict) and field in raw[section]:
            target = raw.setdefault(owner, {})
            if not isinstance(target, dict) or target.get(owned) is not None:
                raise ConfigError(f"{section}.{field}", f"give it once: as {section}.{field} or as "
                                  f"{owner}.{owned}, not both")
            raw = {**raw, section: {k: v for k, v in raw[section].items() if k != field},
                   owner: {**target, owned: raw[section][field]}}
    for name in raw:
        if name not in SECTIONS:
            raise ConfigError(str(name), f"unknown section{_suggest(str(name), list(SECTIONS))}; "
                              f"valid: {list(SECTIONS)}")
    model_raw = raw.get("model") or {}
    if not isinstance(model_raw, dict):
        raise ConfigError("model", f"must be a mapping of fields, got {shown(model_raw)}")
    family = _family(model_raw, trust_plugin)
    model_fields = {k: v for k, v in model_raw.items() if k not in (FAMILY_FIELD, PLUGIN_FIELD)}
    _check_family_fields(family, model_fields, named=FAMILY_FIELD in model_raw)
    sections = {name: _section(name, family.config_class if name == "model" else cls,
                               model_fields if name == "model" else raw.get(name))
                for name, cls in SECTIONS.items()}
    sections["sharding"].resolve().completed(family.axis_roles)  # rules naming axes the family lacks
    return Config(**sections)


def _check_family_fields(family, fields: dict, *, named: bool) -> None:
    """A ConfigError for the first model field that ``family`` lacks but another registered family
    has (``model.num_experts`` on a Llama config): it names those families, not a close spelling."""
    valid = [field.name for field in dataclasses.fields(family.config_class)]
    for key in fields:
        if key in valid:
            continue
        owners = [name for name in families() if name != family.name
                  and key in {field.name for field in dataclasses.fields(family_named(name).config_class)}]
        if owners:
            which = f"{family.name!r}" + ("" if named else " (the default)")
            raise ConfigError(f"model.{key}", f"is not a field of model.family {which}; the "
                              f"{'family' if len(owners) == 1 else 'families'} {', '.join(map(repr, owners))} "
                              f"{'has' if len(owners) == 1 else 'have'} it: set model.family: "
                              f"{' or '.join(owners)} to use it; fields of {family.name!r}: {valid}")
        return  # a field no family has: the unknown-field error, with a close spelling


class UntrustedPlugin(ConfigError):
    """A recorded config names a ``model.plugin`` that loading it would import (run) without
    ``--trust-plugin``."""

    def __init__(self, plugin: str):
        super().__init__("model.plugin", f"the model names the plugin {plugin}: loading it runs that Python "
                         f"code, so it is imported only when asked; pass {TRUST_PLUGIN_FLAG} if you trust it "
                         "(or import the family yourself)")


def _family(model_raw: dict, trust_plugin: bool):
    """The family ``model.family`` names, after importing ``model.plugin`` when given (and trusted,
    or already imported: then no code runs)."""
    try:
        plugin = model_raw.get(PLUGIN_FIELD)
        if plugin is not None:
            if not isinstance(plugin, str) or not plugin:
                raise ConfigError("model.plugin", "must be a module name such as my_models.gpt or a .py file, "
                                  f"got {shown(plugin)}")
            if not trust_plugin and not plugin_imported(plugin):
                raise UntrustedPlugin(plugin)
            import_plugin(plugin)
        name = model_raw.get(FAMILY_FIELD, DEFAULT_FAMILY)
        return family_named(str(name))
    except UnknownFamily as err:
        raise ConfigError(f"model.{err.field}", err.message) from None


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def model_dict(model_cfg: Any) -> dict:
    """The ``model`` section of a model config: its family (and plugin), then its fields."""
    family = family_of(model_cfg)
    plugin = plugin_of(family)
    return {FAMILY_FIELD: family.name, **({PLUGIN_FIELD: plugin} if plugin else {}), **_plain(model_cfg)}


def to_dict(cfg: Config) -> dict:
    """A YAML-ready plain dict of ``cfg`` (enums as their values, the model section with its family)."""
    return {**_plain(cfg), "model": model_dict(cfg.model)}


def _origin(sources: dict, path: tuple) -> str:
    """Where the value at ``path`` came from: its leaf in the provenance tree, else ``DEFAULT``."""
    node: Any = sources
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return DEFAULT
        node = node[key]
    return node if isinstance(node, str) else DEFAULT


def annotated_yaml(cfg: Config, sources: dict, column: int = 48) -> str:
    """``cfg`` as YAML (``load_config`` reads it back to ``cfg``), each value followed by a comment
    saying where it came from (``resolve_config``'s ``sources``): ``# from FILE``, ``# from the
    command line`` or ``# default``. Comments start at ``column`` where the lines allow."""
    lines: list[tuple[str, str | None]] = []

    def walk(mapping: dict, path: tuple, indent: str) -> None:
        for key, value in mapping.items():
            head = f"{indent}{yamlio.one_line(key)}:"
            if isinstance(value, dict) and value:
                lines.append((head, None))
                walk(value, (*path, key), indent + "  ")
            else:
                lines.append((f"{head} {yamlio.one_line(value)}", _origin(sources, (*path, key))))

    walk(to_dict(cfg), (), "")
    breaks = str.maketrans({"\n": "\\n", "\r": "\\r", "\x85": "\\x85", "\u2028": "\\u2028",
                            "\u2029": "\\u2029"})  # a file name's line break would end the comment
    return "".join(f"{text:<{column}}  # {origin.translate(breaks)}\n" if origin else f"{text}\n"
                   for text, origin in lines)
