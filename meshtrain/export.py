"""``python -m meshtrain.export --run RUN_DIR --out DIR [--step N] [--host-devices N] [--trust-plugin]``

Writes the parameters of a run's checkpoint (the latest complete one, or ``--step N``), without the
optimizer state, to ``DIR/params`` (orbax, a plain nested dict of fp32 arrays) and the model config
to ``DIR/meshtrain.json``. Start a fine-tune from it with ``checkpoint.init_from=DIR``.

The checkpoint is restored onto the mesh it was written on when the device count allows, else onto
``fsdp`` over all devices; either way each device reads only its shards. Bad input prints one
``error: field: what is wrong`` line and exits 2.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp

from meshtrain.checkpoint import RunCheckpoints, UnreadableCheckpoint, resolve_restore_path
from meshtrain.cli import ArgumentParser, add_trust_plugin_argument, run, use_host_devices
from meshtrain.config import to_dict
from meshtrain.data.chat_template import CHAT_TEMPLATE_FILE
from meshtrain.data.tokenizer import TOKENIZER_FILE
from meshtrain.errors import ConfigError, new_output
from meshtrain.mesh import make_mesh
from meshtrain.weights.export_format import save_params
from meshtrain.weights.loading import recorded_config, restore_run


def _parse_args(argv: list[str] | None):
    parser = ArgumentParser(prog="python -m meshtrain.export", description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="run directory (or its checkpoints/ or one step directory)")
    parser.add_argument("--out", required=True, help="new directory for the parameters")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    parser.add_argument("--host-devices", type=int, metavar="N", help="simulate N CPU devices")
    add_trust_plugin_argument(parser)
    args = parser.parse_args(argv)
    if args.overrides:
        parser.error(f"unrecognized arguments: {' '.join(args.overrides)}")
    return args


def _written_mesh(run: str, step: int | None, trust_plugin: bool):
    """The mesh the checkpoint was written on when this process has as many devices, else fsdp over all."""
    root, given_step = resolve_restore_path(run, field="--run")
    source = RunCheckpoints(root, read_only=True)
    try:
        step = source.pick_step(step, given_step)
        try:
            meta = source.read_meta(step)
        except UnreadableCheckpoint as err:
            raise ConfigError("--run", f"checkpoint {source.path(step)} is unreadable ({err}); pass --step to "
                              f"export another of {source.steps()}") from None
    finally:
        source.close()
    mesh_cfg = recorded_config(meta["config"], source.path(step), "--run", trust_plugin).mesh
    if int(meta.get("devices", 0)) != len(jax.devices()):
        mesh_cfg = dataclasses.replace(mesh_cfg, data=1, fsdp=-1, tensor=1, stage=1)
    return make_mesh(mesh_cfg)


def export(run: str, out: str, step: int | None = None, *, trust_plugin: bool = False) -> pathlib.Path:
    """Exports the parameters of checkpoint ``step`` (default latest) of ``run`` to ``out``, in model
    layer order (whatever pipeline wrote the checkpoint). The run's ``model.plugin`` is
    imported only with ``trust_plugin``."""
    out_dir = pathlib.Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError("--out", f"{out} exists and is not empty; choose a new directory")
    cfg, sharded, restored = restore_run(run, _written_mesh(run, step, trust_plugin), step=step, field="--run",
                                         trust_plugin=trust_plugin)
    config = to_dict(cfg)
    with new_output(out_dir, "--out"):
        meta = {"step": restored.step, "source": str(restored.path), "model": config["model"], "config": config}
        written = save_params(out_dir, sharded.model_params(restored.state, jnp.float32), meta)
        for name in (TOKENIZER_FILE, CHAT_TEMPLATE_FILE):  # the run's, when its data recorded them
            recorded = restored.path.parent.parent / name
            if jax.process_index() == 0 and recorded.is_file():
                shutil.copyfile(recorded, written / name)
    if jax.process_index() == 0:
        print(f"exported the parameters of {restored.path} (step {restored.step}, {cfg.model.num_params:,} "
              f"parameters) to {written}; fine-tune with checkpoint.init_from={written}", file=sys.stderr)
    return written


def _export(argv: list[str] | None) -> None:
    args = _parse_args(argv)
    if args.host_devices is not None:
        use_host_devices(args.host_devices)
    export(args.run, args.out, args.step, trust_plugin=args.trust_plugin)


def main(argv: list[str] | None = None) -> int:
    return run(_export, argv)


if __name__ == "__main__":
    sys.exit(main())
