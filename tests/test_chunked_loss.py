"""Chunked cross-entropy (``meshtrain.loss``, ``train.loss_chunk``): the head and the loss in chunks of
the vocabulary give the unchunked loss and gradients, stay vocab-parallel under tensor parallelism, keep
the temporaries of a 65,536-word vocabulary near those of a 512-word one, and run in a pipeline's
head; a chunk left to the devices (null) is one pass where the logits fit (no recomputed FLOPs),
else the largest chunk within the memory the rest of the step takes.

Tolerances (fp32): on one device, chunked against unchunked, loss rel 1e-6 and every gradient rel
L2 1e-6 per parameter (only the order of the chunks' sums differs; observed 1.9e-7 and 4.1e-7);
across layouts (tensor and context parallel, pipeline) against one device unchunked, rel 1e-5 as in
tests/test_pipeline.py (observed at most 9.4e-8 and 7.5e-7).
"""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from meshtrain.config import load_config
from meshtrain.data import DataConfig, global_batch, make_dataset
from meshtrain.errors import ConfigError
from meshtrain.measure.flops import count_flops
from meshtrain.measure.hlo import collective_counts
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.loss import MAX_LOSS_CHUNKS, chunk_size
from meshtrain.parallel.layout import Layout
from meshtrain.planner.constants import LOGITS_FP32_COPIES, Compiler
from meshtrain.planner.estimate import layout_estimate
from meshtrain.planner.head import loss_chunks
from meshtrain.planner.roofline import Hardware
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.train_config import TrainConfig
from meshtrain.trainer import Trainer
from models.common import RematPolicy
from utils import initial_state, MODEL, OPTIMIZER, TRAIN, loss_and_grads, make_trainer, relative_l2

# 20 entries per chunk do not divide the 96-word vocabulary: chunks of 16 (6 chunks).
CHUNK = 20


def _assert_equal(reference, result, tolerance):
    ref_loss, ref_grads = reference
    loss, grads = result
    assert loss == pytest.approx(ref_loss, rel=tolerance)
    assert grads.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        assert relative_l2(grads[name], expected) <= tolerance, (name, relative_l2(grads[name], expected))


@pytest.fixture(scope="module")
def unchunked():
    return loss_and_grads(make_trainer((1, 1, 1, 1), loss_chunk=0))


def test_chunk_sizes_divide_the_vocabulary_and_keep_its_tensor_split():
    assert chunk_size(96, CHUNK) == 16 and chunk_size(96, 0) == 96 and chunk_size(96, 200) == 96
    assert chunk_size(36, 8) == 6 and chunk_size(37, 8) == 1  # a prime vocabulary: chunks of one entry
    assert chunk_size(64, 12, 4) == 8  # a multiple of the 4-way split of vocab
    assert chunk_size(64, 2, 4) == 4  # never fewer entries than the split's devices
    with pytest.raises(ConfigError) as info:
        TrainConfig(loss_chunk=-1)
    assert info.value.field == "loss_chunk"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.loss_chunk=-8"])
    assert info.value.field == "train.loss_chunk" and "\n" not in str(info.value)
    assert TrainConfig().loss_chunk is None and load_config(None, ["train.loss_chunk=null"]).train.loss_chunk is None


def test_more_than_the_most_chunks_is_refused_in_one_line_and_never_chosen():
    """A chunk that cuts the vocabulary into more than ``MAX_LOSS_CHUNKS`` (256) chunks: 256 entries
    of Llama 3's 128,256 (501 chunks: the value meant as positions, its meaning before it counted
    vocabulary entries), any chunk of a prime vocabulary (chunks of one entry). The planner's
    candidates of such a vocabulary are one pass alone."""
    mesh = {"data": 1, "fsdp": 1, "tensor": 1, "stage": 1}

    def problems(vocab, chunk):
        layout = Layout.of(dataclasses.replace(MODEL, vocab_size=vocab), mesh, Preset.FSDP_TP.rules,
                           TrainConfig(batch_size=2, loss_chunk=chunk))
        return [(p.field, p.message) for p in layout.problems()], layout

    assert MAX_LOSS_CHUNKS == 256
    found, _ = problems(128256, 256)
    assert found == [("train.loss_chunk", "256 runs the vocabulary of 128,256 entries in 501 chunks of 256 (at most "
                      "256; the value counts vocabulary entries per chunk, run as the largest divisor of the "
                      "vocabulary not above it); use null (chosen for the devices), 0 (one pass) or at least 501")]
    assert problems(128256, 501)[0] == [] and problems(128256, 500)[0] != []  # 256 chunks of 501; 334 of 384
    assert problems(128256, 0)[0] == [] and problems(128256, None)[0] == []
    found, prime = problems(65521, 4096)
    assert [field for field, _ in found] == ["train.loss_chunk"] and "in 65,521 chunks of 1 " in found[0][1]
    assert loss_chunks(prime.with_loss_chunk(None)) == [0]
    load_config(None, ["train.loss_chunk=256"])  # a config alone cannot know the vocabulary: the layout refuses


# 4,096 positions of a 32,768-word vocabulary beside layers of embed 256: one pass needs more than the
# layers' phase, chunks of up to 4,096 entries fit under it.
BUDGETED = dataclasses.replace(MODEL, vocab_size=32768, seq_len=4096, embed_dim=256, mlp_dim=2048, head_dim=64,
                               remat=RematPolicy.FULL)


def test_the_chunk_left_to_the_devices_is_one_pass_where_it_fits_else_the_largest_within_the_budget():
    """The planner's choice (no compile): the candidates are one pass and halvings of the vocabulary
    down to 1,024 entries; one pass where the step then fits the device memory for certain, not a byte
    less; else (and with the memory unknown) the largest chunk whose step needs no more than the
    smallest's: 4,096 entries here, where 8,192 would need more."""
    layout = Layout.of(BUDGETED, {"data": 1, "fsdp": 1, "tensor": 1, "stage": 1}, Preset.FSDP_TP.rules,
                       TrainConfig(batch_size=2))
    hw = Hardware(compiler=Compiler.XLA_CPU)
    assert loss_chunks(layout) == [0, 16384, 8192, 4096, 2048, 1024]
    needed = {chunk: layout_estimate(layout.with_loss_chunk(chunk), 4, hw).needed for chunk in loss_chunks(layout)}
    assert needed[0] > needed[8192] > needed[4096] == needed[1024] == min(needed.values())
    assert layout_estimate(layout, 4, hw, device_memory=needed[0]).loss_chunk == 0
    assert layout_estimate(layout, 4, hw, device_memory=needed[0] - 1).loss_chunk == 4096
    assert layout_estimate(layout, 4, hw).loss_chunk == 4096
    # A config's chunk stays as it is.
    assert layout_estimate(layout.with_loss_chunk(2048), 4, hw, device_memory=needed[0]).loss_chunk == 2048


def test_the_chosen_one_pass_has_the_unchunked_flops_and_no_recompute():
    """512 positions: with the memory to hold their logits, the trainer runs one pass, says so at
    start-up, and its step's matmul FLOPs are the unchunked step's exactly; chunks of 32 of the 96
    entries add the head's recomputed forward, 2 x vocab x embed per token."""
    model, mesh = dataclasses.replace(MODEL, seq_len=512), make_mesh(MeshConfig(), jax.devices()[:1])
    counts = {}
    for chunk in (None, 0, 32):
        layout = Layout.of(model, mesh.shape, Preset.FSDP_TP.rules, dataclasses.replace(TRAIN, batch_size=2,
                                                                                        loss_chunk=chunk))
        trainer = Trainer(layout, mesh, OPTIMIZER, device_memory=2**40)
        counts[chunk] = count_flops(trainer.gradients, trainer.abstract_state(), trainer.abstract_batch()).flops
        if chunk is None:
            assert trainer.layout.train.loss_chunk == 0
            assert trainer.loss_description.startswith("loss: the head over a vocabulary of 96 in one pass")
        if chunk == 32:
            assert " in 3 chunks of 32 entries " in trainer.loss_description
    assert counts[None] == counts[0]
    assert counts[32] - counts[0] == 2 * 2 * 512 * model.vocab_size * model.embed_dim


def test_chunked_loss_and_gradients_equal_the_unchunked(unchunked):
    _assert_equal(unchunked, loss_and_grads(make_trainer((1, 1, 1, 1), loss_chunk=CHUNK)), 1e-6)


@pytest.mark.parametrize("preset", [Preset.FSDP_TP, pytest.param(Preset.FSDP_TP_CP, marks=pytest.mark.slow)],
                         ids=lambda preset: preset.value)
def test_tensor_parallel_chunks_stay_vocab_parallel(unchunked, preset):
    """On (1, 2, 2, 1) vocab split over tensor, each chunk of 16 entries 8 on each device (and under
    fsdp_tp_cp the positions over fsdp, which the chunks keep). Equal to one device; no all-gather in
    the compiled program makes an array with the whole vocabulary (96) in any dimension, and no
    collective-permute moves positions."""
    trainer = make_trainer((1, 2, 2, 1), rules=preset.rules, loss_chunk=CHUNK)
    dataset = make_dataset(DataConfig(), vocab_size=MODEL.vocab_size, seq_len=MODEL.seq_len)
    batch = global_batch(dataset, 0, trainer.layout.train.batch_size, trainer.batch_sharding)
    state = initial_state(trainer)
    compiled = jax.jit(trainer.gradients).lower(state, batch).compile()
    outputs = [match.group(1) for line in compiled.as_text().splitlines()
               if (match := re.match(r"\s*\S+ = (.*?) all-gather(-start)?\(", line))]
    gathered = [shape for output in outputs for shape in re.findall(r"\w+\[([\d,]*)\]", output)]
    assert gathered and not [shape for shape in gathered if str(MODEL.vocab_size) in shape.split(",")], gathered
    assert collective_counts(compiled.as_text())["collective-permute"] == 0
    loss, grads, *_ = compiled(state, batch)
    grads = {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}
    _assert_equal(unchunked, (float(loss), grads), 1e-5)


@pytest.mark.slow
def test_pipeline_head_chunks_equal_one_device(unchunked):
    """2 stages, 1F1B: the last stage's head runs in 6 chunks of 16 entries."""
    trainer = make_trainer((1, 1, 1, 2), pipeline=PipelineConfig(2, Schedule.ONE_F_ONE_B), loss_chunk=CHUNK)
    _assert_equal(unchunked, loss_and_grads(trainer), 1e-5)


# configs/tiny.yaml's model at 512 positions, batch 4, one device.
TINY = dataclasses.replace(MODEL, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=192,
                           seq_len=512)
ROWS, MEMORY_CHUNK = 4, 256
FP32 = 4


@pytest.mark.slow
def test_temporaries_grow_by_the_vocabulary_gradients_and_a_few_chunks():
    """XLA's temp bytes of the fp32 train step (abstract compile) at vocabularies 512 and 65,536, the
    head in chunks of 256 entries. Unchunked they were 155.1 MB and 1,729.2 MB (three fp32 [2,048
    tokens, vocab] buffers); chunked 100.2 MB and 152.2 MB (jax 0.10.2, XLA:CPU, 2026-12-07). Asserted:
    a growth of at most the gradients of the two [vocab, embed] parameters (embedding and head), which
    cannot go, two more head-sized fp32 buffers (the weight's chunk-major slices and their gradients:
    1.13 measured), and the loss phase's LOGITS_FP32_COPIES fp32 [tokens, 256] buffers of one chunk:
    nothing of [tokens, vocab]."""
    temps = {}
    for vocab in (512, 65_536):
        trainer = make_trainer((1, 1, 1, 1), dataclasses.replace(TINY, vocab_size=vocab), batch_size=ROWS,
                               loss_chunk=MEMORY_CHUNK)
        compiled = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        temps[vocab] = compiled.memory_analysis().temp_size_in_bytes
    growth = temps[65_536] - temps[512]
    head = (65_536 - 512) * TINY.embed_dim * FP32
    chunk_buffer = ROWS * TINY.seq_len * MEMORY_CHUNK * FP32
    print(f"\nvocab 512: {temps[512] / 1e6:.1f} MB; vocab 65,536: {temps[65_536] / 1e6:.1f} MB; growth "
          f"{growth / 1e6:.1f} MB = vocabulary gradients {2 * head / 1e6:.1f} MB + {(growth - 2 * head) / head:.2f} "
          f"head-sized buffers of {head / 1e6:.1f} MB")
    assert growth <= 2 * head + 2 * head + LOGITS_FP32_COPIES * chunk_buffer, temps
    assert temps[65_536] < 0.2 * ROWS * TINY.seq_len * 65_536 * FP32 * 3  # far below one pass's three logits
