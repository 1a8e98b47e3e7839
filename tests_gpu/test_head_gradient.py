"""The output head's weight gradient under FSDP on XLA:GPU (compile-only H100s), the head in chunks of
the vocabulary (``meshtrain.loss.head_loss``): each chunk's gradient is reduce-scattered to the
parameter's split as it is made, so the step never holds the head's gradient whole and unsplit (with
chunks of positions it was carried through the chunks' loop in fp32: four 1.96 GiB buffers at 8B
widths) and reduces it once in all (one reduce-scatter per chunk of its 1/chunks slice, not the whole
gradient per chunk)."""

from __future__ import annotations

import re

import pytest

from meshtrain.config import load_config
from meshtrain.gpu_compile import Target, compile_step, topology
from meshtrain.measure.hlo import Module

EMBED, VOCAB, CHUNK, FSDP = 1024, 32768, 4096, 8
OVERRIDES = ["model.num_layers=2", f"model.embed_dim={EMBED}", f"model.vocab_size={VOCAB}", "model.num_heads=8",
             "model.num_kv_heads=8", "model.mlp_dim=3072", f"mesh.fsdp={FSDP}", "train.batch_size=8",
             f"train.loss_chunk={CHUNK}"]


def executions(module: Module) -> dict[str, float]:
    """How many times one step runs each computation that a while loop's body reaches (the entry: once;
    a loop's body: its trip count times its caller's)."""
    runs = {module.entry: 1.0}
    pending = [module.entry]
    while pending:
        name = pending.pop()
        for ins in module.computations.get(name, []):
            if ins.opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", ins.attributes).group(1)
                trips = re.search(r'"known_trip_count":\s*\{\s*"n":\s*"(\d+)"', ins.attributes)
                runs[body] = runs[name] * (int(trips.group(1)) if trips else 1)
                pending.append(body)
    return runs


@pytest.fixture(scope="module")
def step():
    return compile_step(load_config("configs/llama_8b.yaml", OVERRIDES), topology(Target.H100, 1), Target.H100)


def test_the_head_gradient_is_never_whole_and_is_reduce_scattered_once_per_step(step):
    """No array of the head weight's whole [embed, vocab] shape in the module, in any dtype; the
    reduce-scatters of [embed, chunk] slices of the gradient to [embed / 8, chunk] run vocab / chunk
    = 8 times per step (loops counted by their trips, a combined one by its operands): together one
    gradient's bytes, vocab x embed x 4."""
    assert " in 8 chunks of 4096 entries " in " ".join(step.report.kernels), step.report.kernels
    whole = re.findall(rf"\w+\[{EMBED},{VOCAB}\]", step.hlo)
    assert not whole, whole
    module = Module(step.hlo)
    runs = executions(module)
    slices = 0.0
    for name, count in runs.items():
        shapes = {ins.name: ins.result for ins in module.computations[name]}
        for ins in module.computations[name]:
            if ins.opcode in ("reduce-scatter", "reduce-scatter-start"):
                operands = [shapes.get(operand, "") for operand in ins.operands]
                slices += count * sum(bool(re.match(rf"f32\[{EMBED},{CHUNK}\]", o)) for o in operands)
                assert not any(re.match(rf"\w+\[{EMBED},{VOCAB}\]", o) for o in operands), ins
    assert slices == VOCAB // CHUNK
