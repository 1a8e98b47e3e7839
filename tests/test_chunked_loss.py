"""Chunked cross-entropy (``meshtrain.loss``, ``train.loss_chunk``): the head and the loss in chunks of
positions give the unchunked loss and gradients, stay vocab-parallel under tensor parallelism, keep
the temporaries of a 65,536-word vocabulary near those of a 512-word one, and run in a pipeline's
head.

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
from meshtrain.measure.hlo import collective_counts
from meshtrain.loss import chunk_length
from meshtrain.planner.constants import LOGITS_FP32_COPIES
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.train_config import TrainConfig
from utils import MODEL, loss_and_grads, make_trainer, relative_l2

# 6 positions per chunk do not divide the 32 positions: chunks of 4 (8 chunks; a pipeline stage's
# 16 positions: 4 chunks).
CHUNK = 6


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


def test_chunk_lengths_divide_the_positions_and_keep_the_length_split():
    assert chunk_length(32, CHUNK) == 4 and chunk_length(32, 0) == 32 and chunk_length(32, 64) == 32
    assert chunk_length(36, 8) == 6 and chunk_length(37, 8) == 1  # a prime length: chunks of one position
    assert chunk_length(64, 12, 4) == 8  # a multiple of the 4-way split of length
    assert chunk_length(64, 2, 4) == 4  # never fewer positions than the split's devices
    with pytest.raises(ConfigError) as info:
        TrainConfig(loss_chunk=-1)
    assert info.value.field == "loss_chunk"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.loss_chunk=-8"])
    assert info.value.field == "train.loss_chunk" and "\n" not in str(info.value)


def test_chunked_loss_and_gradients_equal_the_unchunked(unchunked):
    _assert_equal(unchunked, loss_and_grads(make_trainer((1, 1, 1, 1), loss_chunk=CHUNK)), 1e-6)


@pytest.mark.parametrize("preset", [Preset.FSDP_TP, pytest.param(Preset.FSDP_TP_CP, marks=pytest.mark.slow)],
                         ids=lambda preset: preset.value)
def test_tensor_parallel_chunks_stay_vocab_parallel(unchunked, preset):
    """On (1, 2, 2, 1) vocab split over tensor (and under fsdp_tp_cp the positions over fsdp, which
    each chunk keeps). Equal to one device; no all-gather in the compiled program makes an array with
    the whole vocabulary (96) in any dimension, and no collective-permute moves positions."""
    trainer = make_trainer((1, 2, 2, 1), rules=preset.rules, loss_chunk=CHUNK)
    dataset = make_dataset(DataConfig(), vocab_size=MODEL.vocab_size, seq_len=MODEL.seq_len)
    batch = global_batch(dataset, 0, trainer.layout.train.batch_size, trainer.batch_sharding)
    state = trainer.init_state(seed=0)
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
    """2 stages, 1F1B: each stage's head runs its 16 positions in chunks of 4."""
    trainer = make_trainer((1, 1, 1, 2), pipeline=PipelineConfig(2, Schedule.ONE_F_ONE_B), loss_chunk=CHUNK)
    _assert_equal(unchunked, loss_and_grads(trainer), 1e-5)


# configs/tiny.yaml's model at 512 positions, batch 4, one device.
TINY = dataclasses.replace(MODEL, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=192,
                           seq_len=512)
ROWS, MEMORY_CHUNK = 4, 8
FP32 = 4


@pytest.mark.slow
def test_temporaries_grow_by_the_vocabulary_gradients_and_a_few_chunks():
    """XLA's temp bytes of the fp32 train step (abstract compile) at vocabularies 512 and 65,536.
    Unchunked they were 155.1 MB and 1,729.2 MB (11x: three fp32 [2,048 tokens, vocab] buffers);
    with chunks of 8 positions 155.1 MB and 188.4 MB. Asserted: at most 1.5x, and a growth of at most
    the gradients of the two [vocab, embed] parameters (embedding and head), which cannot go, plus
    the loss phase's LOGITS_FP32_COPIES fp32 [rows, 8, vocab] buffers (fp32 logits, softmax, their
    gradient) of one chunk: a bound that holds whatever the attention kernel costs."""
    temps = {}
    for vocab in (512, 65_536):
        trainer = make_trainer((1, 1, 1, 1), dataclasses.replace(TINY, vocab_size=vocab), batch_size=ROWS,
                               loss_chunk=MEMORY_CHUNK)
        compiled = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        temps[vocab] = compiled.memory_analysis().temp_size_in_bytes
    growth = temps[65_536] - temps[512]
    vocab_grads = 2 * (65_536 - 512) * TINY.embed_dim * FP32
    chunk_buffer = ROWS * MEMORY_CHUNK * 65_536 * FP32
    print(f"\nvocab 512: {temps[512] / 1e6:.1f} MB; vocab 65,536: {temps[65_536] / 1e6:.1f} MB "
          f"({temps[65_536] / temps[512]:.2f}x); growth {growth / 1e6:.1f} MB = vocabulary gradients "
          f"{vocab_grads / 1e6:.1f} MB + {(growth - vocab_grads) / chunk_buffer:.2f} chunk buffers of "
          f"{chunk_buffer / 1e6:.1f} MB")
    assert temps[65_536] <= 1.5 * temps[512], temps
    assert growth <= vocab_grads + LOGITS_FP32_COPIES * chunk_buffer, temps
