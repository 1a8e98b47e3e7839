"""Shared helpers: run a few train steps of a small model on a given mesh and read the result."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx

from meshtrain.data import DataConfig, global_batch, make_dataset
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.optim import OptimizerConfig
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.offload import OffloadConfig
from meshtrain.parallel.pipeline import PipelineConfig
from meshtrain.parallel.rules import Preset, ShardingRules
from meshtrain.parallel.zero import ZeroConfig
from meshtrain.train_config import TrainConfig
from meshtrain.trainer import Trainer
from models.llama import LlamaConfig

# Distinct sizes, each divisible by every split the tests use, so a transposed axis cannot pass.
MODEL = LlamaConfig(vocab_size=96, embed_dim=40, num_layers=2, num_heads=8, num_kv_heads=4,
                    head_dim=6, mlp_dim=72, seq_len=32)
TRAIN = TrainConfig(steps=3, batch_size=16, log_every=1)
# eps 1e-6 rather than 1e-8: entries whose gradient nearly cancels (|g| ~ 1e-7) differ across
# layouts by fp32 summation order, and Adam's g / sqrt(v) turns that into an O(lr) step difference.
OPTIMIZER = OptimizerConfig(learning_rate=3e-3, warmup_steps=0, eps=1e-6)


@dataclasses.dataclass
class RunResult:
    losses: np.ndarray  # [steps]
    params: dict  # flat {path: np.ndarray}
    trainer: Trainer
    state: object = None  # the final TrainState


def make_trainer(mesh_shape: tuple[int, int, int, int], model=MODEL, *, rules: ShardingRules = Preset.FSDP_TP.rules,
                 pipeline: PipelineConfig = PipelineConfig(), zero: ZeroConfig = ZeroConfig(),
                 offload: OffloadConfig = OffloadConfig(), devices=None, **train_fields) -> Trainer:
    """The one way the tests build a ``Trainer``: ``model`` on a mesh of ``mesh_shape`` over the first
    devices (or ``devices``), ``TRAIN`` with ``train_fields`` replaced, ``OPTIMIZER``."""
    devices = jax.devices()[: math.prod(mesh_shape)] if devices is None else devices
    mesh = make_mesh(MeshConfig(*mesh_shape), devices)
    layout = Layout.of(model, mesh.shape, rules, dataclasses.replace(TRAIN, **train_fields), pipeline, zero, offload)
    return Trainer(layout, mesh, OPTIMIZER)


def trainer_of_config(cfg, devices=None) -> Trainer:
    """The ``Trainer`` of a loaded ``Config`` on its mesh, as ``meshtrain.train`` builds it."""
    mesh = make_mesh(cfg.mesh, devices)
    return Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)


def run_steps(trainer: Trainer) -> RunResult:
    """TRAIN.steps optimizer steps on the embedded Markov data; losses and final parameters."""
    dataset = make_dataset(DataConfig(), vocab_size=trainer.layout.model.vocab_size,
                           seq_len=trainer.layout.model.seq_len)
    state = trainer.init_state(seed=0)
    losses = []
    for step in range(trainer.layout.train.steps):
        batch = global_batch(dataset, step, trainer.layout.train.batch_size, trainer.batch_sharding)
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    params = {".".join(map(str, path)): np.asarray(v.get_value())
              for path, v in nnx.to_flat_state(state.params)}
    return RunResult(np.array(losses), params, trainer, state)


def loss_grads_and_statistics(trainer: Trainer, batch=None) -> tuple[float, dict, dict]:
    """Loss, per-parameter gradients (logical layer order) and the layers' statistics at init,
    on the step-0 batch of the embedded data unless ``batch`` is given."""
    if batch is None:
        dataset = make_dataset(DataConfig(), vocab_size=trainer.layout.model.vocab_size,
                               seq_len=trainer.layout.model.seq_len)
        batch = global_batch(dataset, 0, trainer.layout.train.batch_size, trainer.batch_sharding)
    loss, grads, _, statistics, _ = jax.jit(trainer.gradients)(trainer.init_state(seed=0), batch)
    grads = trainer.layer_order.to_logical(grads)
    return (float(loss), {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)},
            {name: np.asarray(value) for name, value in statistics.items()})


def loss_and_grads(trainer: Trainer) -> tuple[float, dict]:
    """Loss and per-parameter gradients (logical layer order) at init on the step-0 batch."""
    loss, grads, _ = loss_grads_and_statistics(trainer)
    return loss, grads


def relative_l2(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected|| / ||expected|| (0 when both are 0)."""
    norm = np.linalg.norm(expected)
    return float(np.linalg.norm(actual - expected) / norm) if norm else float(np.linalg.norm(actual))


def one_line_error(rc: int, err: str, field: str, *hints: str) -> str:
    """The one error line of a command that exited 2 on bad input (no traceback), naming ``field``
    and holding each of ``hints``."""
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), err
    assert "Traceback" not in err
    for hint in hints:
        assert hint in lines[0], (hint, lines[0])
    return lines[0]



def shard_writes_fill_the_disk(monkeypatch, at_write: int, shard: str) -> None:
    """A prepared corpus' shard writer (``corpus._SplitWriter._write``) that finds the disk full at
    its ``at_write``-th call, naming ``shard`` (its .tmp file) in the OSError; undone by
    ``monkeypatch.undo()`` or at the test's end."""
    import errno
    import os

    from meshtrain.data import corpus

    write, calls = corpus._SplitWriter._write, []

    def filling(self, *args):
        calls.append(self.split)
        if len(calls) == at_write:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.out / f"{shard}.tmp"))
        return write(self, *args)

    monkeypatch.setattr(corpus._SplitWriter, "_write", filling)
