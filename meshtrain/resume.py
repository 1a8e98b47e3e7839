"""Where a run's first state comes from: its own checkpoints, ``checkpoint.restore_from``, or a fresh
init (with ``checkpoint.init_from`` parameters); and the checks of a resumed config against the one
its checkpoint was written with.

Order: ``run.dir``'s newest complete checkpoint (unless ``--fresh``), else ``checkpoint.restore_from``
(a step, a run or a checkpoints directory), else ``Trainer.init_state`` with the parameters of
``checkpoint.init_from`` (an export, a run, or ``hf:DIR``) loaded over the fresh ones.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import jax
from flax import nnx

from meshtrain.checkpoint import (CHECKPOINT_DIR, Restored, RunCheckpoints, UnreadableCheckpoint, config_differences,
                                  reorder_layers, resolve_restore_path)
from meshtrain.config import Config, to_dict
from meshtrain.distributed import log
from meshtrain.errors import ConfigError
from meshtrain.parallel.layer_order import LayerOrder
from meshtrain.trainer import Trainer, TrainState
from meshtrain.weights import hf, peft
from meshtrain.weights.export_format import PARAMS_DIR, check_params, load_params

# Sections whose changes between a checkpoint and the resumed run change the numbers (warned about;
# named as the likely cause when a checkpoint's arrays do not fit).
NUMERIC_SECTIONS = ("model", "optimizer", "data", "train")
# Where the family's module is found does not change the numbers.
HARMLESS_FIELDS = ("train.log_every", "train.profile_steps", "model.plugin")
LENGTH_FIELD = "train.steps"  # a changed length alone: the run was extended (or shortened)


def config_drift(config: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """``["model.embed_dim: 32 there, 40 here", ...]``: the numeric fields of ``config`` (this run's)
    that differ from ``saved`` (a checkpoint's), a field the checkpoint predates counting only when
    set off its default."""
    return [d for d in config_differences(saved, config, NUMERIC_SECTIONS, defaults=to_dict(Config()))
            if not d.startswith(HARMLESS_FIELDS)]


@dataclasses.dataclass
class Start:
    """The first state of a run: ``step`` steps already done (0 for a fresh one)."""

    state: TrainState
    step: int
    restored: Restored | None  # the checkpoint it came from
    note: str | None  # one line for the log: where the state came from


def _restore_from(cfg: Config, trainer: Trainer, config: dict[str, Any]) -> Restored:
    """The state ``checkpoint.restore_from`` names (a step, a run or a checkpoints directory)."""
    field = "checkpoint.restore_from"
    root, step = resolve_restore_path(cfg.checkpoint.restore_from, field=field)
    source = RunCheckpoints(root, read_only=True)
    drift = functools.partial(config_drift, config)
    try:
        if step is None:
            restored = source.restore_latest(trainer.abstract_state(), field=field, layer_order=trainer.layer_order,
                                             move_unreadable=False, drift=drift)
            if restored is None:
                raise ConfigError(field, f"no complete checkpoint in {cfg.checkpoint.restore_from}")
            return restored
        try:
            return source.restore(step, trainer.abstract_state(), field=field, layer_order=trainer.layer_order,
                                  drift=drift)
        except UnreadableCheckpoint as err:
            raise ConfigError(field, f"checkpoint {source.path(step)} is unreadable: {err}") from None
    finally:
        source.close()


def _check_resumed(cfg: Config, restored: Restored, config: dict[str, Any], run_dir: pathlib.Path | None) -> None:
    """Checks a resumed config against the one its checkpoint was written with (``run_dir``: the
    run's own directory it came from; None: ``checkpoint.restore_from``).

    A resumed run continues with the new values, as MaxText and torchtitan resume a run directory
    whatever its config (lowering the learning rate after a spike, extending ``train.steps``): a
    changed numeric field is one warning line naming every change, from which step the new values
    apply and how to start a fresh run instead. Refused (ConfigError): a checkpoint past
    ``train.steps``, and a changed config on a checkpoint already at ``train.steps``, where nothing
    would train with the new values (a sweep that forgot to change ``run.dir``)."""
    if restored.step > cfg.train.steps:
        raise ConfigError("train.steps", f"is {cfg.train.steps}, but checkpoint {restored.path} is "
                          f"already at step {restored.step}; raise train.steps to continue it")
    differences = config_drift(config, restored.meta["config"])
    if not differences:
        return
    changed = "; ".join(differences)
    if run_dir is not None:
        field, where, source = "run.dir", run_dir, f"run.dir {run_dir}"
        fresh = f"give a new run.dir to start a fresh run (or delete {run_dir / CHECKPOINT_DIR})"
        guard = "; --fresh makes resuming an error instead"
    else:
        where = cfg.checkpoint.restore_from
        field, source = "checkpoint.restore_from", f"checkpoint.restore_from {where}"
        fresh, guard = "drop checkpoint.restore_from to start from step 0", ""
    if restored.step == cfg.train.steps and any(not d.startswith(LENGTH_FIELD) for d in differences):
        raise ConfigError(field, f"{where} is already at train.steps={cfg.train.steps} ({restored.path}), "
                          f"written with another config ({changed}), so nothing would train with this one; "
                          f"{fresh}, or raise train.steps to continue it with these values")
    log(f"warning: resuming {source} from step {restored.step} ({restored.path}), written with another config: "
        f"{changed}. This config's values apply from step {restored.step + 1} on (the parameters, optimizer "
        f"moments and data position carry on; train.steps sets the length of the learning-rate schedule); "
        f"{fresh}{guard}")


def _check_init_from(init_from: str) -> None:
    """A one-line ConfigError for a ``checkpoint.init_from`` (without ``hf:``) that is missing or is
    a Hugging Face directory rather than a meshtrain export (``check_params`` reads exports)."""
    root = pathlib.Path(init_from)
    if not root.exists():
        raise ConfigError("checkpoint.init_from", f"no such directory: {init_from}; give a meshtrain export "
                          f"(params/, from python -m meshtrain.export) or {hf.INIT_PREFIX}DIR for a Hugging "
                          "Face checkpoint")
    if (root / hf.CONFIG_FILE).is_file() and not (root / PARAMS_DIR).is_dir():
        raise ConfigError("checkpoint.init_from", f"{init_from} is a Hugging Face checkpoint ({hf.CONFIG_FILE}), "
                          f"not a meshtrain export; write checkpoint.init_from={hf.INIT_PREFIX}{init_from} to "
                          "import it")


def initial_state(cfg: Config, trainer: Trainer, checkpoints: RunCheckpoints | None, run_dir: pathlib.Path,
                  fresh: bool) -> Start:
    """The run's first state (see the module docstring). ``fresh``: a ConfigError when ``run_dir``
    already holds checkpoints. Bad input is found before anything is compiled."""
    own = run_dir / CHECKPOINT_DIR
    if fresh and own.is_dir() and any(p.name.isdigit() for p in own.iterdir()):
        latest = max(int(p.name) for p in own.iterdir() if p.name.isdigit())
        raise ConfigError("--fresh", f"{run_dir} already holds checkpoints (latest: step {latest}); use "
                          "another run.dir, or drop --fresh to resume from them")
    config = to_dict(cfg)
    restored = None
    if checkpoints is not None and not fresh:
        restored = checkpoints.restore_latest(trainer.abstract_state(), field="run.dir",
                                              layer_order=trainer.layer_order, move_unreadable=True,
                                              drift=functools.partial(config_drift, config))
    from_run_dir = restored is not None
    if restored is None and cfg.checkpoint.restore_from is not None:
        restored = _restore_from(cfg, trainer, config)
    if restored is not None:
        _check_resumed(cfg, restored, config, run_dir if from_run_dir else None)
        note = (f"resumed from {restored.path} (step {restored.step}, written on mesh "
                f"{restored.meta.get('mesh')} with {restored.meta.get('devices')} devices)")
        return Start(restored.state, restored.step, restored, note)
    init_from = cfg.checkpoint.init_from
    load = None
    if init_from is not None and init_from.startswith(hf.INIT_PREFIX):  # checked before anything compiles
        load = hf.init_loader(init_from.removeprefix(hf.INIT_PREFIX), trainer)
    elif init_from is not None:  # checked before anything compiles
        _check_init_from(init_from)
        target = check_params(init_from, trainer.abstract_params, trainer.param_shardings,
                              model_config=config["model"])
        load = functools.partial(load_params, init_from, target)
    adapters_from = cfg.train.lora.init_from
    load_adapters = (peft.adapter_loader(adapters_from, trainer.lora, cfg.model, trainer.abstract_params)
                     if adapters_from is not None else None)  # checked before anything compiles
    state = trainer.init_state(cfg.train.seed)
    # What a file gives is in model layer order; an interleaved pipeline stores stage order.
    model_order = LayerOrder(num_layers=cfg.model.num_layers)
    notes = []
    if load is not None:
        jax.tree.map(lambda array: array.delete(), state.params)  # free the fresh ones before loading
        nnx.replace_by_pure_dict(state.params, load())
        # Under LoRA the parameters are frozen in the compute dtype.
        state = state.replace(params=reorder_layers(trainer.held(state.params), model_order, trainer.layer_order))
        notes.append(f"parameters initialised from {init_from}")
    if load_adapters is not None:
        loaded = load_adapters()
        nnx.replace_by_pure_dict(state.adapters, loaded)
        adapters = jax.tree.map(lambda value, sharding: jax.make_array_from_callback(
            value.shape, sharding, lambda index: value[index]), state.adapters, trainer.state_shardings.adapters)
        state = state.replace(adapters=reorder_layers(adapters, model_order, trainer.layer_order))
        notes.append(f"LoRA adapters initialised from {adapters_from}")
    return Start(state, 0, None, "; ".join(notes) or None)
