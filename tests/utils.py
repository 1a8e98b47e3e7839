"""Shared helpers of the test modules: a few train steps of a small model on a given mesh and their
result; configs/tiny.yaml runs in a directory (their config, metrics and checkpoints); the MoE model,
packed documents and HF directories several modules test with; one-line error checks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib

import jax
import numpy as np
from flax import nnx

from meshtrain.checkpoint import CHECKPOINT_DIR, RunCheckpoints
from meshtrain.config import load_config
from meshtrain.data import DataConfig, global_batch, make_dataset
from meshtrain.data.sources import ArrayStream, FileDataset, StreamInfo
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.optim import OptimizerConfig
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.offload import OffloadConfig
from meshtrain.parallel.pipeline import PipelineConfig
from meshtrain.parallel.rules import Preset, ShardingRules
from meshtrain.parallel.zero import ZeroConfig
from meshtrain.train_config import TrainConfig
from meshtrain.trainer import Trainer
from models.api import forward
from models.common import unconstrained
from models.llama import LlamaConfig
from models.moe import MoEConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
TINY_STEPS = 8  # a tiny run's length unless said

# Distinct sizes, each divisible by every split the tests use, so a transposed axis cannot pass.
MODEL = LlamaConfig(vocab_size=96, embed_dim=40, num_layers=2, num_heads=8, num_kv_heads=4,
                    head_dim=6, mlp_dim=72, seq_len=32)
TRAIN = TrainConfig(steps=3, batch_size=16, log_every=1)
# eps 1e-6 rather than 1e-8: entries whose gradient nearly cancels (|g| ~ 1e-7) differ across
# layouts by fp32 summation order, and Adam's g / sqrt(v) turns that into an O(lr) step difference.
OPTIMIZER = OptimizerConfig(learning_rate=3e-3, warmup_steps=0, eps=1e-6)
# The mixture of experts the MoE modules test (models/moe), sizes distinct as MODEL's: 8 experts,
# expert hidden 24, embed 40.
MOE = MoEConfig(vocab_size=96, embed_dim=40, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=6,
                num_experts=8, top_k=2, expert_mlp_dim=24, seq_len=32, group_size=16,
                load_balancing_coef=0.01, z_loss_coef=1e-3)
# A MoE run's config file for the command-line tests.
MOE_YAML = """
mesh: {data: 2, fsdp: 2, tensor: 2, stage: 1}
model: {family: moe, vocab_size: 128, embed_dim: 32, num_layers: 2, num_heads: 4, num_kv_heads: 2,
        head_dim: 8, num_experts: 8, top_k: 2, expert_mlp_dim: 16, seq_len: 32}
train: {steps: 2, batch_size: 8}
"""


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
    mesh = mesh_of(mesh_shape, devices)
    layout = Layout.of(model, mesh.shape, rules, dataclasses.replace(TRAIN, **train_fields), pipeline, zero, offload)
    return Trainer(layout, mesh, OPTIMIZER)


def mesh_of(mesh_shape: tuple[int, int, int, int], devices=None):
    """A mesh of ``mesh_shape`` over the first devices (or ``devices``)."""
    return make_mesh(MeshConfig(*mesh_shape), jax.devices()[: math.prod(mesh_shape)] if devices is None else devices)


def moe_trainer(mesh_shape, model=MOE, pipeline: PipelineConfig = PipelineConfig(), **fields) -> Trainer:
    """``make_trainer`` of the MoE model ``MOE`` (or ``model``)."""
    return make_trainer(mesh_shape, model, pipeline=pipeline, **fields)


def trainer_of_config(cfg, devices=None) -> Trainer:
    """The ``Trainer`` of a loaded ``Config`` on its mesh, as ``meshtrain.train`` builds it."""
    mesh = make_mesh(cfg.mesh, devices)
    return Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)


# Seed-0 states computed on one device, as host arrays, by the fingerprint of their unsharded program.
_INITIAL_STATES: dict[str, object] = {}


def initial_state(trainer: Trainer):
    """``trainer.init_state(seed=0)``'s values in its shardings, computed once per worker for every
    layout whose state program is the same: the program (``trainer.fresh_state``) is lowered without
    shardings, run on one device the first time its text is seen, and its values are put onto the
    layout's shardings. Most layout tests compile nothing else of the init; that the born-sharded
    init gives these values is tests/test_sharding.py's (test_born_sharded_init_equals_one_devices_state)."""
    program = jax.jit(lambda: trainer.fresh_state(0))
    key = hashlib.sha256(program.lower().as_text().encode()).hexdigest()
    if key not in _INITIAL_STATES:
        _INITIAL_STATES[key] = jax.device_get(program())
    return jax.device_put(_INITIAL_STATES[key], trainer.state_shardings)


def run_steps(trainer: Trainer) -> RunResult:
    """TRAIN.steps optimizer steps on the embedded Markov data; losses and final parameters."""
    dataset = make_dataset(DataConfig(), vocab_size=trainer.layout.model.vocab_size,
                           seq_len=trainer.layout.model.seq_len)
    state = initial_state(trainer)
    losses = []
    for step in range(trainer.layout.train.steps):
        batch = global_batch(dataset, step, trainer.layout.train.batch_size, trainer.batch_sharding)
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return RunResult(np.array(losses), flat_params(state), trainer, state)


def loss_grads_and_statistics(trainer: Trainer, batch=None) -> tuple[float, dict, dict]:
    """Loss, per-parameter gradients (logical layer order) and the layers' statistics at init,
    on the step-0 batch of the embedded data unless ``batch`` is given."""
    if batch is None:
        dataset = make_dataset(DataConfig(), vocab_size=trainer.layout.model.vocab_size,
                               seq_len=trainer.layout.model.seq_len)
        batch = global_batch(dataset, 0, trainer.layout.train.batch_size, trainer.batch_sharding)
    loss, grads, _, statistics, _ = jax.jit(trainer.gradients)(initial_state(trainer), batch)
    grads = trainer.layer_order.to_logical(grads)
    return (float(loss), {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)},
            {name: np.asarray(value) for name, value in statistics.items()})


def loss_and_grads(trainer: Trainer) -> tuple[float, dict]:
    """Loss and per-parameter gradients (logical layer order) at init on the step-0 batch."""
    loss, grads, _ = loss_grads_and_statistics(trainer)
    return loss, grads


def assert_moe_matches(reference, result) -> None:
    """Two ``loss_grads_and_statistics`` results of a MoE model equal within fp32 rounding: loss relative
    1e-5, gradients relative L2 1e-5 per parameter, statistics (expert load, dropped fraction, aux
    losses) absolute 1e-6."""
    ref_loss, ref_grads, ref_stats = reference
    loss, grads, stats = result
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        assert relative_l2(grads[name], expected) < 1e-5, name
    assert stats.keys() == ref_stats.keys() and "moe_expert_load" in stats
    for name, expected in ref_stats.items():
        np.testing.assert_allclose(stats[name], expected, rtol=0, atol=1e-6, err_msg=name)


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


# --- configs/tiny.yaml runs in a directory ----------------------------------------------------------------

def overrides(run_dir, *extra, steps=TINY_STEPS) -> list[str]:
    """configs/tiny.yaml shrunk to embed 32, batch 16, fp32, logging every step into ``run_dir``."""
    return ["model.embed_dim=32", "train.batch_size=16", f"train.steps={steps}", "train.log_every=1",
            "run.tensorboard=false", f"run.dir={run_dir}", *extra]


def config(run_dir, *extra, steps=TINY_STEPS):
    """The loaded config of ``overrides(run_dir, *extra, steps=steps)``."""
    return load_config(TINY, overrides(run_dir, *extra, steps=steps))


def records(run_dir) -> list[dict]:
    """The records of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir) -> dict[int, float]:
    """step -> loss; a step logged twice (redone after a restart) keeps its last record."""
    return {record["step"]: record["loss"] for record in records(run_dir)}


def complete_steps(run_dir) -> list[int]:
    """The steps of a run's complete checkpoints, ascending."""
    root = pathlib.Path(run_dir) / CHECKPOINT_DIR
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


def restore(run_dir, step, cfg):
    """Checkpoint ``step`` of ``run_dir`` restored onto the trainer of ``cfg``."""
    checkpoints = RunCheckpoints(pathlib.Path(run_dir) / CHECKPOINT_DIR, read_only=True)
    try:
        trainer = trainer_of_config(cfg)
        return checkpoints.restore(step, trainer.abstract_state(), field="test", layer_order=trainer.layer_order)
    finally:
        checkpoints.close()


def flat_params(state) -> dict[str, np.ndarray]:
    """A train state's parameters as {dotted path: array}."""
    return {".".join(map(str, path)): np.asarray(value.get_value())
            for path, value in nnx.to_flat_state(state.params)}


# --- packed documents -------------------------------------------------------------------------------------

def packed_dataset(seed: int = 0, num_tokens: int = 600, seq_len: int = 32) -> FileDataset:
    """Random tokens (ids below 96) cut into documents of 1..16 tokens (every window of ``seq_len``
    holds at least two; some cross windows)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 17, num_tokens)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    starts = np.concatenate([starts[starts < num_tokens], [num_tokens]])
    info = StreamInfo("random documents", document_starts=starts)
    return FileDataset(ArrayStream(rng.integers(0, 96, num_tokens)), info, seq_len=seq_len, seed=seed)


def logits_alone(params, graphdef, inputs: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Logits [rows, length, vocab] where every document piece of each row ran alone (one device):
    each piece at the start of a row of its own, zero-padded after it (causal attention: what follows
    a token does not change its logits)."""
    pieces, places = [], []
    for row in range(inputs.shape[0]):
        for segment in np.unique(segments[row]):
            where = np.flatnonzero(segments[row] == segment)
            pieces.append(np.pad(inputs[row, where], (0, inputs.shape[1] - where.size)))
            places.append((row, where))
    run = jax.jit(lambda p, tokens: forward(nnx.merge(graphdef, p), tokens, unconstrained))
    logits = np.asarray(run(params, jax.numpy.asarray(np.stack(pieces))))
    out = np.zeros((*inputs.shape, logits.shape[-1]), np.float32)
    for piece, (row, where) in zip(logits, places):
        out[row, where] = piece[:where.size]
    return out


# --- Hugging Face directories written without transformers -----------------------------------------------

def random_params(cfg) -> nnx.State:
    """Parameters of model config ``cfg`` drawn with numpy (random norm scales around 1, the rest
    N(0, 0.1^2)): no compilation, where a jitted init takes XLA:CPU many seconds to compile its random draws."""
    from meshtrain.parallel.layout import abstract_model

    rng = np.random.default_rng(3)
    _, abstract = abstract_model(cfg)
    return nnx.from_flat_state([
        (path, variable.replace(jax.numpy.asarray(
            (path[-1] == "scale") + rng.normal(0.0, 0.2 if path[-1] == "scale" else 0.1, variable.shape),
            np.float32))) for path, variable in nnx.to_flat_state(abstract)])


def tiny_hf(path: pathlib.Path, *, config=None, edit=None, model=()) -> pathlib.Path:
    """An HF directory (config.json, model.safetensors) of the Llama that ``overrides()`` runs train
    (embed_dim 32; ``model``: more ``model.*`` overrides), every weight 0.02 and every norm 1, written
    without transformers. ``config``: keys to set in config.json; ``edit(tensors)``: changes the
    tensors before they are saved."""
    from safetensors.numpy import save_file

    from meshtrain.parallel.layout import abstract_model
    from meshtrain.weights import hf
    from models.api import family_of

    cfg = load_config(TINY, ["model.embed_dim=32", *model]).model
    _, abstract = abstract_model(cfg)
    tensors = {name: np.full(tensor_map.hf_shape, 1.0 if "norm" in name else 0.02, np.float32)
               for tensor_map in hf.tensor_maps(family_of(cfg).hf, cfg, abstract)
               for name in tensor_map.hf_tensors(cfg.num_layers)}
    if edit is not None:
        edit(tensors)
    path.mkdir(parents=True)
    (path / hf.CONFIG_FILE).write_text(json.dumps({**hf.hf_config(cfg, dtype="float32"), **(config or {})}))
    save_file(tensors, str(path / hf.SINGLE_FILE), metadata={"format": "pt"})
    return path


def refused_from_hf(source, out, capsys) -> str:
    """``convert from-hf`` of ``source`` into ``out``: its stderr, once exit 2 and nothing written are checked."""
    from meshtrain import convert

    assert convert.main(["from-hf", "--hf", str(source), "--out", str(out)]) == 2
    assert not out.exists()
    return capsys.readouterr().err
