"""Checkpoints of a run: orbax saves of the ``TrainState`` plus JSON metadata, and their restore.

Files of ``run.dir/checkpoints`` (one orbax ``CheckpointManager``)::

    <step>/state        the TrainState (params, Adam moments, loss scale, counters), orbax standard
    <step>/meta         JSON: step, data position, seeds, resolved config, mesh it was written on,
                        the order its stacked layers are stored in (``layer_order``)
    <step>.orbax-checkpoint-tmp/        a save that never finished (ignored; orbax replaces it when
                                        that step is saved again, logging a warning)
    <step>.unreadable[-k]/              a checkpoint that failed to restore, moved aside, kept

A step directory appears only when its save has completed: orbax writes into the temporary
directory and renames it on commit, so a process killed mid-save leaves a ``tmp`` directory that no
restore picks up. A complete checkpoint that fails to restore (a truncated file, say) is moved
aside with a warning naming it, and the previous one is tried.

Restores go straight into the shardings of the current mesh: the target is the trainer's abstract
state (``ShapeDtypeStruct``s carrying ``NamedSharding``s), so no device ever holds a full copy.

The step number of a checkpoint is the number of optimizer steps completed. Batches are a pure
function of ``(data.seed, step)``, so the step is also the data position; there is no other RNG
state (parameter init is seeded by ``train.seed`` and only used for a fresh start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from meshtrain.distributed import log
from meshtrain.errors import ConfigError, cut
from meshtrain.parallel.layer_order import LayerOrder

CHECKPOINT_DIR = "checkpoints"  # under run.dir
# 1: the first format; 2: every checkpoint's meta holds its arrays' checksums, so that a meta which
# lost them is detected (a format-1 checkpoint may have none).
FORMAT_VERSION = 2
_TMP_MARK = ".orbax-checkpoint-tmp"
_UNREADABLE = ".unreadable"
SAVE_MARGIN_BYTES = 16 * 10 ** 6  # beyond a checkpoint's own size: metadata, the meta JSON
CHECKSUMS = "checksums"  # meta key: {array path: checksum of its values when saved}
LAYER_ORDER = "layer_order"  # meta key: {stages, virtual_stages, num_layers} (absent before it was recorded)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Saving, resuming and fault handling of a run (``checkpoint`` section).

    ``init_from`` is also accepted as ``model.init_from``: it lives here because the model config describes
    a model's shape, not where its weights come from.
    """

    enabled: bool = True  # false: no saves and no automatic resume
    every: int = 100  # save every N completed steps; 0 = only time-based, preemption and final saves
    every_minutes: float = 0.0  # also save when this many minutes passed since the last save; 0 = off
    keep: int = 3  # complete checkpoints kept (oldest deleted by orbax)
    async_save: bool = True  # write in a background thread; the step loop only waits for the D2H copy
    restore_from: str | None = None  # start from this checkpoint when run.dir has none of its own
    init_from: str | None = None  # parameters only (an export dir): fine-tune start, fresh optimizer

    def __post_init__(self):
        if self.every < 0:
            raise ConfigError("every", f"must be >= 0 (0 = no step-based saves), got {self.every}")
        if self.every_minutes < 0:
            raise ConfigError("every_minutes", f"must be >= 0 (0 = off), got {self.every_minutes}")
        if self.keep < 1:
            raise ConfigError("keep", f"must be a positive integer, got {self.keep}")
        if self.restore_from is not None and self.init_from is not None:
            raise ConfigError("init_from", "give either checkpoint.restore_from (the whole train state) "
                              "or checkpoint.init_from (parameters only), not both")
        for name in ("restore_from", "init_from"):
            if getattr(self, name) == "":
                raise ConfigError(name, "must be a path or null, got the empty string")


class SaveFailed(ConfigError):
    """A checkpoint could not be written (the run stops with one line; the earlier ones are intact).

    ``background``: orbax's writer threads failed (they may still be failing as the process exits).
    """

    def __init__(self, field: str, message: str, *, background: bool = True):
        super().__init__(field, message)
        self.background = background


def _write_problem(err: BaseException) -> str:
    """The operating system's reason in an orbax/tensorstore write error ("No space left on device"),
    else its first line."""
    text = " ".join(str(err).split())
    found = re.findall(r": ([A-Z][a-z][^:\[\]]*?) \[os_error_code", text)
    return found[-1] if found else one_line(err)[:200]


class UnreadableCheckpoint(Exception):
    """A complete-looking checkpoint whose files cannot be read back."""


@dataclasses.dataclass
class Restored:
    state: Any  # TrainState in the current mesh's shardings
    step: int
    meta: dict
    path: pathlib.Path


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"params.layers.mlp.gate.value": (shape, dtype)}`` of a tree of arrays, abstract arrays or
    orbax ``ArrayMetadata`` (attribute, dict and sequence keys all become plain names)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(_key_name(k) for k in path): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
            for path, leaf in leaves}


def _flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat_config(value, name + "."))
        else:
            flat[name] = value
    return flat


def config_differences(old: dict, new: dict, sections: tuple[str, ...], defaults: dict | None = None) -> list[str]:
    """``["model.embed_dim: 32 there, 40 here", ...]`` for the fields under ``sections`` (sections or
    dotted prefixes: ``"train.fp8"``) that differ; a field ``old`` lacks (written before it existed)
    whose value here is its default in ``defaults`` is no difference. (A resumed run's drift from
    its checkpoint is ``meshtrain.resume.config_drift``.)"""
    old_flat, new_flat, default_flat = _flat_config(old), _flat_config(new), _flat_config(defaults or {})
    within = lambda key: any(key == section or key.startswith(section + ".") for section in sections)
    return [f"{key}: {old_flat.get(key)!r} there, {new_flat.get(key)!r} here"
            for key in sorted(set(old_flat) | set(new_flat))
            if within(key) and old_flat.get(key) != new_flat.get(key)
            and not (key not in old_flat and key in default_flat and new_flat.get(key) == default_flat[key])]


def check_compatible(saved: dict[str, tuple], wanted: dict[str, tuple], *, field: str, where: str,
                     differences: list[str]) -> None:
    """Raises a ``ConfigError`` on ``field`` when the saved arrays do not fit the wanted ones."""
    problems = [f"{name} is missing there" for name in wanted if name not in saved]
    problems += [f"{name} is there but not in this model" for name in saved if name not in wanted]
    problems += [f"{name} has shape {list(saved[name][0])} {saved[name][1]} there but "
                 f"{list(wanted[name][0])} {wanted[name][1]} here"
                 for name in wanted if name in saved and saved[name] != wanted[name]]
    if problems:
        hint = ("; the configs differ in " + ", ".join(differences[:6])) if differences else ""
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(field, f"{where} does not fit this run: {problems[0]}{more}{hint}")


def step_dir_name(path: pathlib.Path) -> int | None:
    """The step of a complete checkpoint directory name (``"12"``), else None."""
    return int(path.name) if path.name.isdigit() else None


def incomplete_saves(root: pathlib.Path) -> list[pathlib.Path]:
    """Temporary directories of saves that never finished, oldest step first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _TMP_MARK in p.name),
                  key=lambda p: (int(p.name.split(".")[0]) if p.name.split(".")[0].isdigit() else -1, p.name))


_ORBAX_SOURCE = pathlib.Path(ocp.__file__).parent  # where orbax's own log records come from


def _read_only_notice(record: logging.LogRecord) -> bool:
    """Orbax's warnings that a read-only manager is read-only (every tool run would print them)."""
    return record.getMessage().startswith(("Given directory is read only", "CheckpointManagerOptions.read_only=True"))


def _failed_write_report(record: logging.LogRecord) -> bool:
    """The tracebacks orbax's threads and waits log when a save's write fails (the caller gets the error too)."""
    return (record.levelno >= logging.ERROR and record.exc_info is not None
            and pathlib.Path(record.pathname).is_relative_to(_ORBAX_SOURCE))


def _late_write_callback(args) -> bool:
    """asyncio's "Event loop is closed" as a failed save's tensorstore writes complete after orbax closed its loop."""
    return (isinstance(args.exc_value, RuntimeError) and str(args.exc_value) == "Event loop is closed"
            and any(f.f_code.co_name == "call_soon_threadsafe" for f, _ in traceback.walk_tb(args.exc_traceback)))


@contextlib.contextmanager
def _absl_records_dropped(drop: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """Within the block, the ``absl`` logger (orbax logs through it) drops the records ``drop`` picks."""
    keep, logger = (lambda record: not drop(record)), logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


@contextlib.contextmanager
def _failed_saves_quiet() -> Iterator[None]:
    """While saves are in flight: orbax's reports of a failed write are dropped (it reaches the run as one
    ``SaveFailed`` line), all else passes; the hook it replaced is put back (unless replaced meanwhile)."""
    previous = sys.unraisablehook
    unraisable = lambda args: None if _late_write_callback(args) else previous(args)
    sys.unraisablehook = unraisable
    try:
        with _absl_records_dropped(_failed_write_report):
            yield
    finally:
        if sys.unraisablehook is unraisable:
            sys.unraisablehook = previous


class RunCheckpoints:
    """The checkpoints of one directory: async saves of (state, meta), keep-last-K, restore.

    Args:
      root: the checkpoints directory (``run.dir/checkpoints``).
      keep: complete checkpoints kept; ``None`` keeps all (read-only use).
      async_save: whether ``save`` returns once the arrays are copied off the devices.
      read_only: a directory this run does not own (``restore_from``): no saves, no renames.
    """

    def __init__(self, root: str | pathlib.Path, *, keep: int | None = None, async_save: bool = True,
                 read_only: bool = False):
        self.root = pathlib.Path(root).absolute()
        self.read_only = read_only
        self._quiet: contextlib.ExitStack | None = None  # _failed_saves_quiet() from a save until waited for
        with _absl_records_dropped(_read_only_notice):
            options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                   create=not read_only, read_only=read_only)
            self._manager = ocp.CheckpointManager(self.root, options=options, item_handlers={
                "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def pick_step(self, requested: int | None, given: int | None = None) -> int:
        """``requested`` (``--step``), else ``given`` (a step directory), else the latest; a
        ConfigError on ``--step`` when that checkpoint is not there."""
        steps = self.steps()
        step = requested if requested is not None else given if given is not None else steps[-1]
        if step not in steps:
            raise ConfigError("--step", f"no complete checkpoint {step} in {self.root}; there are {steps}")
        return step

    def path(self, step: int) -> pathlib.Path:
        return self.root / str(step)

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts saving ``state`` as checkpoint ``step``; returns once the arrays are off the devices
        (async) or written (sync). Waits for the previous save first.

        Raises:
          SaveFailed: this save, or the previous asynchronous one, could not be written.
        """
        self._check_free_space(step, state)
        meta = {**meta, CHECKSUMS: state_checksums(state)}
        if self._quiet is None:  # the first save since the last wait
            self._quiet = contextlib.ExitStack()
            self._quiet.enter_context(_failed_saves_quiet())
        with self._writing(step):
            self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        """Blocks until every started save is committed (``SaveFailed`` when one could not be)."""
        with self._waiting():
            self._manager.wait_until_finished()

    def close(self) -> None:
        with self._waiting():
            self._manager.close()

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Around orbax's waits: a failure becomes ``SaveFailed``; then no save is in flight (quiet ends)."""
        try:
            with self._writing(None):
                yield
        finally:
            if self._quiet is not None:
                self._quiet.close()
                self._quiet = None

    def _check_free_space(self, step: int, state: Any) -> None:
        """``SaveFailed`` before anything is written when the file system cannot hold another
        checkpoint: this process's shards, uncompressed (an upper bound), plus a margin."""
        needed = sum(shard.data.nbytes for leaf in jax.tree.leaves(state) for shard in leaf.addressable_shards
                     if shard.replica_id == 0)
        needed += needed // 10 + SAVE_MARGIN_BYTES
        free = shutil.disk_usage(self.root if self.root.exists() else self.root.parent).free
        if free < needed:
            raise SaveFailed("checkpoint", f"cannot write checkpoint {step} in {self.root}: it needs about "
                             f"{needed / 1e6:,.0f} MB and {free / 1e6:,.0f} MB are free; the complete "
                             f"checkpoints there are intact ({self.steps() or 'none'}); free space, then resume",
                             background=False)

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """Turns orbax's failure to write (a full disk, a file size limit, no permission), raised
        in the next call after an asynchronous save, into one ``SaveFailed``."""
        try:
            yield
        except SaveFailed:
            raise
        except Exception as err:  # noqa: BLE001 - whatever orbax or the filesystem raised becomes SaveFailed
            complete = [s for s in self.steps() if s != step]
            raise SaveFailed("checkpoint", f"cannot write a checkpoint in {self.root} ({_write_problem(err)}); "
                             f"the complete checkpoints there are intact ({complete or 'none'}); free space "
                             "or fix the directory, then resume") from None

    def read_meta(self, step: int) -> dict:
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as err:  # any read failure makes the checkpoint unusable
            raise UnreadableCheckpoint(one_line(err)) from err
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise UnreadableCheckpoint("its meta item holds no step")
        config, mesh = meta.get("config"), meta.get("mesh")
        if not isinstance(config, dict) or not isinstance(config.get("model"), dict) \
                or not isinstance(config["model"].get("num_layers"), int):
            raise UnreadableCheckpoint("its meta item holds no config with a model section")
        if not isinstance(mesh, dict) or not all(isinstance(size, int) for size in mesh.values()) \
                or not isinstance(mesh.get("stage", 1), int):
            raise UnreadableCheckpoint("its meta item holds no mesh")
        order, names = meta.get(LAYER_ORDER), [f.name for f in dataclasses.fields(LayerOrder)]
        if order is not None and not (isinstance(order, dict) and sorted(order) == sorted(names)
                                      and all(isinstance(v, int) and v > 0 for v in order.values())):
            raise UnreadableCheckpoint(f"its meta's {LAYER_ORDER} {order!r} is not {{{', '.join(names)}}} "
                                       "of positive integers")
        return meta

    def saved_shapes(self, step: int) -> dict[str, tuple]:
        try:
            shapes = flat_shapes(self._manager.item_metadata(step)["state"])
        except Exception as err:
            raise UnreadableCheckpoint(one_line(err)) from err
        if not shapes:  # e.g. state/_METADATA deleted: orbax reports no arrays rather than failing
            raise UnreadableCheckpoint("its state holds no array metadata")
        return shapes

    def restore(self, step: int, abstract_state: Any, *, field: str, layer_order: LayerOrder,
                drift: Callable[[dict], list[str]] | None = None) -> Restored:
        """Checkpoint ``step`` restored into ``abstract_state``'s shardings, its stacked layers
        converted from the order the checkpoint stores them in to ``layer_order``. ``drift``: the
        fields of a saved config that differ from this run's, named when the arrays do not fit.

        Raises:
          ConfigError: on ``field`` when the checkpoint holds a different model or optimizer state.
          UnreadableCheckpoint: when its files cannot be read.
        """
        meta = self.read_meta(step)
        saved = self.saved_shapes(step)
        wanted = flat_shapes(abstract_state)
        check_compatible(saved, wanted, field=field, where=f"checkpoint {self.path(step)}",
                         differences=drift(meta["config"]) if drift is not None and saved != wanted else [])
        try:
            unsaved = _empty_fields_not_saved(abstract_state, self._manager.item_metadata(step)["state"])
            target = abstract_state if not unsaved else {f.name: getattr(abstract_state, f.name)
                                                         for f in dataclasses.fields(abstract_state)
                                                         if f.name not in unsaved}
            state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
            if unsaved:
                state = abstract_state.replace(**state)
            jax.block_until_ready(state)
        except Exception as err:
            raise UnreadableCheckpoint(one_line(err)) from err
        held_step = getattr(state, "step", None)  # a TrainState's; a directory renamed from another step's
        if held_step is not None and int(held_step) != step:
            raise UnreadableCheckpoint(f"its directory says step {step} but its state is step {int(held_step)}'s")
        expected = meta.get(CHECKSUMS)
        written_in = meta.get("format", 1)
        if not isinstance(written_in, int) or written_in > FORMAT_VERSION:
            raise UnreadableCheckpoint(f"its meta's format {written_in!r} is not one this meshtrain reads "
                                       f"(1..{FORMAT_VERSION})")
        if expected is None and written_in >= 2:
            raise UnreadableCheckpoint(f"its meta (format {written_in}) has lost its {CHECKSUMS}: its arrays "
                                       "cannot be checked")
        if expected is not None and not isinstance(expected, dict):
            raise UnreadableCheckpoint(f"its meta's {CHECKSUMS} are not a mapping of array names to checksums")
        if expected is not None:  # format-1 checkpoints written before checksums have none
            found = state_checksums(state)
            wrong = [name for name, value in expected.items() if found.get(name) != value]
            if wrong:
                raise UnreadableCheckpoint(f"the array data of {wrong[0]} (and {len(wrong) - 1} more) does not "
                                           "match the checksum recorded when it was saved")
        return Restored(state=reorder_layers(state, stored_layer_order(meta), layer_order), step=step, meta=meta,
                        path=self.path(step))

    def restore_latest(self, abstract_state: Any, *, field: str, layer_order: LayerOrder, move_unreadable: bool,
                       drift: Callable[[dict], list[str]] | None = None) -> Restored | None:
        """The newest checkpoint that restores, or None when there is none.

        Unreadable ones are reported with a warning naming them and skipped; with
        ``move_unreadable`` (a directory this run owns) each is renamed to ``<step>.unreadable`` so
        that later saves of that step do not collide with it. Nothing is deleted.

        Raises:
          ConfigError: when a checkpoint does not fit the model, or when every one is unreadable.
        """
        for partial in incomplete_saves(self.root):
            log(f"warning: ignoring incomplete checkpoint {partial} (a save that never finished; kept, "
                "remove it when no longer needed)")
        steps = self.steps()
        skipped = []
        for step in reversed(steps):
            try:
                return self.restore(step, abstract_state, field=field, layer_order=layer_order, drift=drift)
            except UnreadableCheckpoint as err:
                path = self.path(step)
                kept = path
                if move_unreadable and not self.read_only:
                    kept = _move_aside(path)
                    self._manager.reload()
                older = [s for s in steps if s < step]
                then = f"trying step {older[-1]}" if older else "no older checkpoint left"
                log(f"warning: checkpoint {path} is unreadable ({err}); kept as {kept}; {then}")
                skipped.append(str(kept))
        if skipped:
            raise ConfigError(field, f"no readable checkpoint in {self.root}: every one failed to restore "
                              f"({', '.join(skipped)}); see the warnings above")
        return None


def reorder_layers(state: Any, stored: LayerOrder, target: LayerOrder) -> Any:
    """``state`` (sharded arrays; any tree holding parameter-like States) with its stacked layers
    moved from ``stored`` order to ``target`` order, in the same shardings (one jitted permutation)."""
    if stored.same_permutation(target):
        return state
    shardings = jax.tree.map(lambda array: array.sharding, state)
    return jax.jit(lambda s: stored.convert(s, target), out_shardings=shardings, donate_argnums=0)(state)


def _empty_fields_not_saved(abstract_state: Any, saved: Any) -> set[str]:
    """The fields of a dataclass state that hold no arrays and that a checkpoint written before they
    existed lacks (``TrainState.fp8`` of a run without FP8): restored as the empty values they are."""
    if not dataclasses.is_dataclass(abstract_state) or not hasattr(saved, "keys"):
        return set()
    return {f.name for f in dataclasses.fields(abstract_state)
            if f.name not in set(saved.keys()) and not jax.tree.leaves(getattr(abstract_state, f.name))}


def _bits(x: jax.Array) -> jax.Array:
    """``x``'s bits as uint32 (2- and 1-byte types widened)."""
    width = jnp.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def _checksums(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One uint32 per array: the sum of its bits times odd weights of their position, wrapping. A
    single flipped bit always changes it, and it does not depend on how the array is sharded."""
    def checksum(x: jax.Array) -> jax.Array:
        strides = np.cumprod((1, *x.shape[::-1]))[-2::-1] if x.ndim else ()
        index = sum((jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(int(stride) % 2 ** 32)
                     for d, stride in enumerate(strides)), jnp.zeros(x.shape, jnp.uint32))
        return jnp.sum(_bits(x) * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)

    return {name: checksum(x) for name, x in arrays.items()}


def state_checksums(state: Any) -> dict[str, int]:
    """``{array path: checksum}`` of the arrays of ``state`` in device memory (computed there;
    arrays resting in host memory, an offloaded optimizer state, are left out)."""
    arrays = {"/".join(map(_key_name, path)): leaf
              for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
              if getattr(leaf.sharding, "memory_kind", None) != "pinned_host"}
    # Replicated scalars: every process reads its own copy (a multi-process array is not fully
    # addressable, so device_get would refuse it).
    return {name: int(np.asarray(value.addressable_data(0))) for name, value in _checksums(arrays).items()}


def _move_aside(path: pathlib.Path) -> pathlib.Path:
    target = path.with_name(path.name + _UNREADABLE)
    index = 1
    while target.exists():
        target = path.with_name(f"{path.name}{_UNREADABLE}-{index}")
        index += 1
    if jax.process_index() == 0:
        path.rename(target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"meshtrain: moved {path}")
    return target


def one_line(err: BaseException) -> str:
    """``err`` as one line of at most 300 characters (its type's name when it says nothing)."""
    return cut(str(err), 300) or type(err).__name__


def resolve_restore_path(path: str, *, field: str = "checkpoint.restore_from") -> tuple[pathlib.Path, int | None]:
    """``(checkpoints root, step or None for its latest)`` for a step directory, a run directory or a
    checkpoints directory.

    Raises:
      ConfigError: when ``path`` is missing, is an unfinished save or holds no complete checkpoint.
    """
    given = pathlib.Path(path)
    if not given.exists():
        raise ConfigError(field, f"no such directory: {path}")
    if not given.is_dir():
        raise ConfigError(field, f"{path} is a file; give a run directory, its checkpoints/ directory "
                          "or one step directory such as checkpoints/12")
    if _TMP_MARK in given.name:
        raise ConfigError(field, f"{path} is an incomplete checkpoint (a save that never finished); "
                          "give a complete one")
    step = step_dir_name(given)
    if step is not None and (given / "meta").exists():
        return given.parent, step
    root = given / CHECKPOINT_DIR if (given / CHECKPOINT_DIR).is_dir() else given
    if not any(step_dir_name(p) is not None for p in root.iterdir()):
        raise ConfigError(field, f"no complete checkpoint in {path} (expected a run directory, its "
                          "checkpoints/ directory or one step directory such as checkpoints/12)")
    return root, None


def checkpoint_meta(*, step: int, config: dict, mesh: jax.sharding.Mesh, layer_order: LayerOrder, batch_size: int,
                    data_seed: int, train_seed: int) -> dict:
    """The JSON saved next to the state (``layer_order``: how its stacked layers are stored)."""
    return {"format": FORMAT_VERSION, "step": step,
            "data": {"seed": data_seed, "next_example": step * batch_size},
            "train_seed": train_seed, "mesh": {name: int(size) for name, size in mesh.shape.items()},
            LAYER_ORDER: dataclasses.asdict(layer_order),
            "devices": int(mesh.devices.size), "processes": jax.process_count(),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config": config}


def stored_layer_order(meta: dict) -> LayerOrder:
    """The order a checkpoint's stacked layers are stored in: its meta's ``layer_order`` (checked by
    ``read_meta``); a checkpoint written before it was recorded: derived from its config and mesh."""
    if LAYER_ORDER in meta:
        return LayerOrder(**meta[LAYER_ORDER])
    return LayerOrder.of_config(meta["config"], meta["mesh"].get("stage", 1))
