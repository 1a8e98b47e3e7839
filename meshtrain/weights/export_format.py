"""The params-only export format: what ``python -m meshtrain.export`` and ``convert from-hf`` write and
``checkpoint.init_from`` and the tools read::

    <out>/params            the parameters as a plain nested dict, orbax standard (no optimizer state)
    <out>/meshtrain.json    JSON: the model section, the step it was exported at, the HF source if any

Restores go straight into the target shardings (each device reads only its shards).
"""

from __future__ import annotations

import json
import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx

from meshtrain import jsonio
from meshtrain.checkpoint import CHECKPOINT_DIR, check_compatible, config_differences, flat_shapes, one_line
from meshtrain.errors import ConfigError

PARAMS_DIR = "params"  # under an export directory
EXPORT_META = "meshtrain.json"  # under an export directory


def save_params(out: str | pathlib.Path, params: nnx.State, meta: dict) -> pathlib.Path:
    """Writes ``params`` (as a plain nested dict) to ``out/params`` and ``meta`` to ``out/meshtrain.json``."""
    out = pathlib.Path(out).absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / PARAMS_DIR, nnx.to_pure_dict(params))
        checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        (out / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def check_params(path: str, abstract_params: nnx.State, shardings: nnx.State, *, model_config: dict,
                 field: str = "checkpoint.init_from") -> dict:
    """The restore target (a plain nested dict of ``ShapeDtypeStruct``s in ``shardings``) for the
    exported parameters at ``path``, after checking that they fit the model; reads no arrays.

    Raises:
      ConfigError: on ``field`` when ``path`` is not an export or its shapes do not fit the model.
    """
    root = pathlib.Path(path).absolute()
    if not (root / PARAMS_DIR).is_dir():
        hint = (" (this is a run directory: export it first with python -m meshtrain.export "
                f"--run {path} --out DIR, or use checkpoint.restore_from)"
                if (root / CHECKPOINT_DIR).is_dir() else "")
        raise ConfigError(field, f"{path} holds no exported parameters ({PARAMS_DIR}/ is missing){hint}")
    try:
        meta = jsonio.loads((root / EXPORT_META).read_text())
    except (OSError, ValueError):
        meta = {}
    target = nnx.to_pure_dict(jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
        abstract_params, shardings))
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            saved = flat_shapes(checkpointer.metadata(root / PARAMS_DIR).item_metadata)
        except Exception as err:  # noqa: BLE001 - any unreadable directory is one ConfigError
            raise ConfigError(field, f"cannot read {root / PARAMS_DIR}: {one_line(err)}") from None
    check_compatible(saved, flat_shapes(target), field=field, where=f"exported parameters {path}",
                     differences=config_differences({"model": meta.get("model", {})},
                                                    {"model": model_config}, ("model",)))
    return target


def load_params(path: str, target: dict, *, field: str = "checkpoint.init_from") -> dict:
    """The exported parameters at ``path`` restored into ``target`` (from ``check_params``)."""
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            return checkpointer.restore(pathlib.Path(path).absolute() / PARAMS_DIR, target)
        except Exception as err:  # noqa: BLE001 - the same
            raise ConfigError(field, f"cannot read {pathlib.Path(path) / PARAMS_DIR}: {one_line(err)}") from None
