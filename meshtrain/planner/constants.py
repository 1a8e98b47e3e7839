"""The planner's one table of constants: the sizes it counts in, and every constant fitted to a
compiler, with where it was measured (``MEASURED``: compiler, jaxlib, date, what).

A fitted constant describes one compiler's buffer assignment on one jaxlib: the same program's
temporaries move with both (docs/memory.md). Refit them with ``scripts/plan_accuracy.py`` and
update the constant's row here together with its value.
"""

from __future__ import annotations

import dataclasses

from models.common import RematPolicy

# Sizes, not fitted.
FP32 = 4
BATCH_BYTES_PER_TOKEN = 3 * 4  # inputs, targets (int32) and mask (f32)
STATE_SCALAR_BYTES = 64  # step, skipped_steps, loss scale, Adam/schedule counts (rounded up)


@dataclasses.dataclass(frozen=True)
class Measured:
    """Where a fitted constant was measured: the compiler, the jaxlib, the date, on what."""

    compiler: str
    jaxlib: str
    date: str
    on: str


# Fitted to XLA:CPU's ``memory_analysis`` of the real train step (scripts/plan_accuracy.py).
# The margin on temp bytes a layout without a pipeline must fit with to be vouched for (``fits``):
# set at 12% of the estimate when the accuracy matrix's largest shortfall was -10.5% of XLA:CPU's (8B,
# remat none, since modelled); on the matrix of 2026-12-05 (28 layouts, dropless MoE and FP8 included)
# the largest is -3.5%, and the margin is kept for the shapes it lacks.
TEMP_MARGIN = 0.12
# Multiplier of one layer's structural working set (``FamilyCosts.layer_bytes``' ``working``), fitted
# (minimax) to XLA:CPU's temp bytes of the real fp32 train step on mesh (1, 8, 1, 1), ZeRO-3, over 13
# model shapes per policy (docs/memory.md): XLA reuses some buffers within the layer's backward.
ACTIVATION_COEFFICIENTS: dict[RematPolicy, float] = {
    RematPolicy.NONE: 0.82,
    RematPolicy.FULL: 0.92,
    RematPolicy.DOTS: 0.75,
}
# The loss phase holds one chunk's logits (``train.loss_chunk`` positions per row: ``meshtrain.loss``)
# in the compute dtype and three fp32 [chunk tokens, vocab] buffers (fp32 logits, softmax, their
# gradient); it is live before the layers' backward, so the peak takes the larger of the two phases.
LOGITS_FP32_COPIES = 3
# Residual-stream-wide fp32 buffers per token that a layer's backward holds for tensor parallelism's
# reductions, fitted on 8B-class layouts (1, 1, 8, 1) and (1, 2, 4, 1) with sequence parallelism
# (docs/memory.md): 12.8 and 13.8 of them, 11 keeping the other TP layouts of the matrix within 10%.
TENSOR_REDUCTION_BUFFERS = 11
# Residual-stream-wide fp32 vectors per token and layer in ZB-H1's cut besides its compute-dtype
# values (XLA:CPU's buffers of the 8B ZB-H1 layouts: four, beside their bf16 copies).
CUT_FP32_RESIDUALS = 4
# Bytes per element XLA:CPU holds the values the step keeps (stash, compute copies of the layers)
# in: it widens bf16 to fp32.
HELD = 4

_CPU_NOV30 = Measured("XLA:CPU", "0.10.2", "2026-11-30", "fp32 train steps of 13 Llama shapes, mesh (1, 8, 1, 1)")
_CPU_DEC05 = Measured("XLA:CPU", "0.10.2", "2026-12-05", "the accuracy matrix: 28 layouts at 8B-10B widths "
                      "(docs/memory.md)")
MEASURED: dict[str, Measured] = {
    "TEMP_MARGIN": _CPU_DEC05,
    "ACTIVATION_COEFFICIENTS": _CPU_NOV30,
    "LOGITS_FP32_COPIES": _CPU_NOV30,
    "TENSOR_REDUCTION_BUFFERS": _CPU_DEC05,
    "CUT_FP32_RESIDUALS": _CPU_DEC05,
    "HELD": _CPU_DEC05,
}
