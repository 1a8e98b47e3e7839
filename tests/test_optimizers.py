"""Learning-rate schedules against their closed forms, each optimizer equal to one device under ZeRO-3 x TP,
and bad optimizer input as one line (meshtrain/optim.py)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from meshtrain.optim import LRSchedule, OptimizerConfig, OptimizerName, learning_rate_schedule
from meshtrain.parallel.zero import ZeroConfig, ZeroStage
from meshtrain.train import main
from meshtrain.trainer import Trainer
from utils import make_trainer, run_steps

PEAK, FLOOR_RATIO, WARMUP, STEPS = 1e-3, 0.1, 10, 100
FLOOR = PEAK * FLOOR_RATIO


def _closed_form(schedule: LRSchedule, step: int, decay_fraction: float = 0.2) -> float:
    if step < WARMUP:
        return PEAK * step / WARMUP
    after = step - WARMUP
    if schedule is LRSchedule.COSINE:
        return FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * min(after / (STEPS - WARMUP), 1)))
    if schedule is LRSchedule.LINEAR:
        return PEAK + (FLOOR - PEAK) * min(after / (STEPS - WARMUP), 1)
    if schedule is LRSchedule.CONSTANT:
        return PEAK
    if schedule is LRSchedule.INVERSE_SQRT:
        return PEAK * math.sqrt(WARMUP / (after + WARMUP))
    decay = round(decay_fraction * (STEPS - WARMUP))  # WSD
    stable_end = STEPS - decay
    return PEAK if step < stable_end else PEAK + (FLOOR - PEAK) * min((step - stable_end) / decay, 1)


@pytest.mark.parametrize("schedule", list(LRSchedule), ids=lambda s: s.value)
def test_each_schedule_is_its_closed_form(schedule):
    cfg = OptimizerConfig(learning_rate=PEAK, schedule=schedule, warmup_steps=WARMUP, min_lr_ratio=FLOOR_RATIO)
    lr = learning_rate_schedule(cfg, STEPS)
    for step in (0, 1, 5, 9, 10, 11, 40, 79, 80, 81, 90, 99, 100):
        np.testing.assert_allclose(float(lr(step)), _closed_form(schedule, step), rtol=1e-5, atol=1e-12,
                                   err_msg=f"{schedule.value} at step {step}")


def test_wsd_decays_over_its_fraction():
    cfg = OptimizerConfig(learning_rate=PEAK, schedule="wsd", warmup_steps=WARMUP, min_lr_ratio=FLOOR_RATIO,
                          decay_fraction=0.5)
    lr = learning_rate_schedule(cfg, STEPS)
    assert float(lr(54)) == pytest.approx(PEAK) and float(lr(56)) < PEAK
    assert float(lr(STEPS)) == pytest.approx(FLOOR)
    for step in (0, 30, 55, 70, 100):
        assert float(lr(step)) == pytest.approx(_closed_form(LRSchedule.WSD, step, 0.5), rel=1e-5, abs=1e-12)


# Lion steps by lr * sign(update): a coordinate whose update is within rounding of zero moves by
# +-lr as the summation order decides, so its losses agree less closely (rel 1.4e-5 at step 3 with
# XLA:CPU's fusion emitters, the only ones of jax >= 0.11; 2e-7 with the tests' elemental emitter on
# jax 0.10.2); the others within 3e-6 on both.
@pytest.mark.parametrize("name, learning_rate, rtol", [
    pytest.param(OptimizerName.LION, 1e-3, 5e-5, id="lion", marks=pytest.mark.slow),
    pytest.param(OptimizerName.ADAFACTOR, 1e-2, 1e-5, id="adafactor", marks=pytest.mark.slow),
    pytest.param(OptimizerName.MUON, 1e-2, 1e-5, id="muon")])
def test_each_optimizer_under_zero3_and_tensor_parallelism_equals_one_device(name, learning_rate, rtol):
    """Three steps on (2, 2, 2, 1) with ZeRO-3: the losses of one device (fp32, within ``rtol``); the
    state leaves shaped like a parameter live in its ZeRO layout (``optimizer_shardings``), and the
    loss falls."""
    optimizer = OptimizerConfig(name=name, learning_rate=learning_rate, warmup_steps=0)
    losses = {}
    for shape in ((1, 1, 1, 1), (2, 2, 2, 1)):
        base = make_trainer(shape, zero=ZeroConfig(ZeroStage.PARAMETERS))
        trainer = Trainer(base.layout, base.mesh, optimizer)
        losses[shape] = run_steps(trainer).losses
    # The moments of the 8-device run are split like their parameters (not replicated).
    specs = [s.spec for s in jax.tree.leaves(trainer.optimizer_compute_shardings)]
    assert sum(any(spec) for spec in specs) >= len(jax.tree.leaves(trainer.abstract_params)) // 2, specs
    np.testing.assert_allclose(losses[(2, 2, 2, 1)], losses[(1, 1, 1, 1)], rtol=rtol)
    assert losses[(1, 1, 1, 1)][-1] < losses[(1, 1, 1, 1)][0]


@pytest.mark.parametrize("override, field, hint", [
    ("optimizer.name=sgd", "optimizer.name", "adamw | lion | adafactor | muon"),
    ("optimizer.schedule=step", "optimizer.schedule", "| wsd |"),
    ("optimizer.decay_fraction=0", "optimizer.decay_fraction", "(0, 1]"),
    ("optimizer.decay_fraction=1.5", "optimizer.decay_fraction", "(0, 1]"),
])
def test_bad_optimizer_input_is_one_line(tmp_path, capsys, override, field, hint):
    assert main(["--config", "configs/tiny.yaml", override, f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: ") and hint in err[0], err
