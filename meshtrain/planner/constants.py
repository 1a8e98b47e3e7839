"""The planner's constants: the sizes it counts in, and per compiler one table of fitted constants
(``Constants``: XLA:GPU's for GPUs, XLA:CPU's for the simulated CPU devices of the tests), each with
where it was measured (``Measured``: compiler, jaxlib, date, on what).

A fitted constant describes one compiler's buffer assignment on one jaxlib: the same program's
temporaries move with both (docs/memory.md). Refit them with ``scripts/plan_accuracy.py`` (XLA:GPU's
measured rows are kept in scripts/plan_accuracy_gpu.json, so ``--from-record`` refits without
compiling) and update the constant's row together with its value.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from models.common import RematPolicy

# Sizes, not fitted.
FP32 = 4
BATCH_BYTES_PER_TOKEN = 3 * 4  # inputs, targets (int32) and mask (f32)
STATE_SCALAR_BYTES = 64  # step, skipped_steps, loss scale, Adam/schedule counts (rounded up)
# The remat policies the estimate models (every table fits a coefficient for each).
MODELLED_REMATS = (RematPolicy.NONE, RematPolicy.FULL, RematPolicy.DOTS)


class Compiler(str, enum.Enum):
    """The compiler whose buffer assignment a table of constants describes."""

    XLA_CPU = "XLA:CPU"
    XLA_GPU = "XLA:GPU"

    @classmethod
    def of_platform(cls, platform: str) -> Compiler:
        """The compiler that builds steps for devices of ``platform`` (``jax.Device.platform``)."""
        return cls.XLA_CPU if platform == "cpu" else cls.XLA_GPU


@dataclasses.dataclass(frozen=True)
class Measured:
    """Where a fitted constant was measured: the compiler, the jaxlib, the date, on what."""

    compiler: str
    jaxlib: str
    date: str
    on: str


@dataclasses.dataclass(frozen=True)
class Constants:
    """One compiler's fitted constants (``TABLES``); ``measured``: each field's ``Measured`` row.

    ``activation_coefficients``: multiplier of one layer's structural working set
    (``FamilyCosts.layer_bytes``' ``working``) per remat policy: XLA reuses some buffers within the
    layer's backward. ``logits_fp32_copies``: fp32 [chunk tokens, vocab] buffers of the loss phase
    beside one chunk's logits in the compute dtype (fp32 logits, softmax, their gradient).
    ``one_pass_fp32_copies``: the same of a head run in one pass (``train.loss_chunk`` 0: nothing
    forces the fp32 pieces apart, XLA:GPU fuses them into one); ``one_pass_shares_gradient``: one
    pass's projection gradient (fp32, before its reduction) reuses the fp32 logits' buffer, dead by
    then, instead of adding to it.
    ``tensor_reduction_buffers``: residual-stream-wide fp32 buffers per token that a layer's backward
    holds for tensor parallelism's reductions below fp32 (XLA:CPU promotes bf16 all-reduces to fp32).
    ``cut_fp32_residuals``: residual-wide fp32 vectors per token and layer in ZB-H1's cut beside its
    compute-dtype values. ``held``: bytes per element the step holds the values it keeps (stash,
    compute copies of the layers, context parallelism's gathered keys and values) in; None: the
    compute dtype (XLA:CPU widens bf16 to fp32, its dynamic-update-slices of bf16 are upcast).
    ``widened_chunk``: a pipeline chunk's layers are widened to fp32 while they run (XLA:CPU computes
    bf16 matmuls in fp32). ``copied_carries``: a loop that both writes and reads a carried buffer
    holds it twice (XLA:CPU copies it instead of updating it in place). ``projection_copies``: copies
    the loss phase holds of the vocabulary projection ZeRO-3 gathers and of its fp32 gradient summed
    over the batch's devices (XLA:CPU: the forward's and the backward's gathers, the all-reduce's
    operand and result; XLA:GPU reduce-scatters, one each). ``update_in_place``: the optimizer's update
    writes the moments and parameters in place, holding no fp32 temporary per optimizer element
    (``meshtrain.planner.state.held_state``). ``checked_pipelines``: every pipeline layout of the
    compiler's accuracy matrix is within its bound, so the planner vouches for pipelines like them
    (``fits``: no sequence or context parallelism, no experts in the stages) as for the rest.
    ``gathered_copies``: one layer's ZeRO-3-gathered fp32 weights the layer phase holds at once
    (XLA:GPU's asynchronous gathers fetch the next layer's while one runs, beside its bf16 cast).
    ``accumulated_stash_copies``: copies of the backward's stash that ``train.grad_accum`` > 1 holds
    besides the microbatch's own; ``tensor_zero3_stash_copies``: the same where ZeRO-3 gathers
    tensor-parallel layers (``meshtrain.planner.state.accumulation_bytes``).
    ``pipeline_head_copies``: gathered copies of the vocabulary projection that each of a pipeline's
    loops running the head takes (0: it rests as its ZeRO-3 shard, the loss gathering its chunks).
    ``update_split_moments``: fp32 values per element of the optimizer moments of the stacked layers'
    weights that tensor parallelism splits, which ZeRO-1/2's update holds besides the new shards: their
    new moments written beside the old ones (``meshtrain.planner.state.held_state``)."""

    compiler: Compiler
    activation_coefficients: Mapping[RematPolicy, float]
    logits_fp32_copies: float
    one_pass_fp32_copies: float
    one_pass_shares_gradient: bool
    tensor_reduction_buffers: float
    cut_fp32_residuals: float
    held: int | None
    widened_chunk: bool
    copied_carries: bool
    projection_copies: int
    update_in_place: bool
    checked_pipelines: bool
    gathered_copies: float
    accumulated_stash_copies: float
    tensor_zero3_stash_copies: float
    update_split_moments: float
    pipeline_head_copies: int
    measured: Mapping[str, Measured]

    def __post_init__(self):
        fields = {f.name for f in dataclasses.fields(self)} - {"compiler", "measured"}
        if set(self.measured) != fields:
            raise ValueError(f"Constants.measured must name every fitted field {sorted(fields)}, "
                             f"got {sorted(self.measured)}")
        if set(self.activation_coefficients) != set(MODELLED_REMATS):
            raise ValueError("Constants.activation_coefficients must have one coefficient per remat policy in "
                             f"{[r.value for r in MODELLED_REMATS]}")

    def held_bytes(self, compute_bytes: int) -> int:
        """Bytes per element of the values the step keeps, for a step computing in ``compute_bytes``."""
        return compute_bytes if self.held is None else self.held


# The margin on temp bytes a layout must fit with to be vouched for (``fits``), both compilers: set at
# 12% of the estimate when XLA:CPU's accuracy matrix's largest shortfall was -10.5% (8B, remat none,
# since modelled); kept for the shapes the matrices lack.
TEMP_MARGIN = 0.12
MARGIN_MEASURED = Measured("XLA:CPU", "0.10.2", "2026-12-05", "the accuracy matrix: 28 layouts at 8B-10B widths")

_CPU_NOV30 = Measured("XLA:CPU", "0.10.2", "2026-11-30", "fp32 train steps of 13 Llama shapes, mesh (1, 8, 1, 1)")
_CPU_DEC04 = Measured("XLA:CPU", "0.10.2", "2026-12-04", "fp32 train steps of configs/tiny.yaml's model at "
                      "vocab 512 and 65,536, one device (docs/long_context.md)")
_CPU_DEC05 = Measured("XLA:CPU", "0.10.2", "2026-12-05", "the accuracy matrix: 28 layouts at 8B-10B widths "
                      "(docs/memory.md)")
XLA_CPU = Constants(
    Compiler.XLA_CPU,
    # Fitted (minimax) to XLA:CPU's temp bytes of the real fp32 train step on mesh (1, 8, 1, 1),
    # ZeRO-3, over 13 model shapes per policy (docs/memory.md).
    activation_coefficients={RematPolicy.NONE: 0.82, RematPolicy.FULL: 0.92, RematPolicy.DOTS: 0.75},
    logits_fp32_copies=3,
    # Unchunked (tests/test_chunked_loss.py's table, vocab 65,536, fp32): 1,574 MB of growth, about
    # three fp32 [tokens, vocab] buffers beside the gradients, as chunked.
    one_pass_fp32_copies=3,
    one_pass_shares_gradient=False,
    # Fitted on 8B-class layouts (1, 1, 8, 1) and (1, 2, 4, 1) with sequence parallelism: 12.8 and 13.8
    # of them, 11 keeping the other TP layouts of the matrix within 10%.
    tensor_reduction_buffers=11,
    # XLA:CPU's buffers of the 8B ZB-H1 layouts: four, beside their bf16 copies.
    cut_fp32_residuals=4,
    held=4,
    widened_chunk=True,
    copied_carries=True,
    projection_copies=2,
    update_in_place=False,
    checked_pipelines=False,
    gathered_copies=1,
    accumulated_stash_copies=0,
    tensor_zero3_stash_copies=0,
    update_split_moments=0,
    pipeline_head_copies=2,
    measured={"activation_coefficients": _CPU_NOV30, "logits_fp32_copies": _CPU_NOV30, "projection_copies": _CPU_NOV30,
              "one_pass_fp32_copies": _CPU_DEC04, "one_pass_shares_gradient": _CPU_DEC04,
              **dict.fromkeys(("tensor_reduction_buffers", "cut_fp32_residuals", "held", "widened_chunk",
                               "copied_carries", "update_in_place", "checked_pipelines", "gathered_copies",
                               "accumulated_stash_copies", "tensor_zero3_stash_copies", "update_split_moments",
                               "pipeline_head_copies"), _CPU_DEC05)},
)

_GPU_DEC07 = Measured("XLA:GPU", "0.11.2", "2026-12-07", "H100 and H200 accuracy matrix (scripts/plan_accuracy.py "
                      "--compiler gpu, scripts/plan_accuracy_gpu.json)")
_GPU_KEPT = Measured("XLA:GPU", "0.11.2", "2026-12-07", "XLA:CPU's value kept, checked on the same matrix: the "
                     "rows it decides are within 10% with it")
_GPU_ONE_PASS = Measured("XLA:GPU", "0.11.2", "2026-12-07", "the buffer assignment of an H100 step at 8B widths, "
                         "2 layers, mesh (1, 8, 1, 1), seq 8192, one pass (docs/memory.md)")
_GPU_VOCAB_CHUNKS = Measured("XLA:GPU", "0.11.2", "2026-12-07", "the matrix compiled again with the head in "
                             "vocabulary chunks (train.loss_chunk=16384): 1 minimises the rows outside 10%")
_GPU_ACCUMULATION = Measured("XLA:GPU", "0.11.2", "2026-12-07", "the matrix's 15 accumulation layouts (8B-70B, "
                             "ZeRO-1/2/3, tensor parallelism, a pipeline): XLA holds 0 to 0.4 more stashes where "
                             "ZeRO-3 gathers tensor-parallel layers (5 rows), 0.6 to 2.2 elsewhere (3.3 where the "
                             "stash is under 1 GB); the smallest value that leaves none more than 10% under XLA's "
                             "peak")
_GPU_UPDATE = Measured("XLA:GPU", "0.11.2", "2026-12-07", "the matrix's ZeRO-1/2 rows whose update is the peak "
                       "(8B and 10B, tensor 1, 2 and 4): 10B on (1,2,4,1) needs 1.45, 8B on (1,4,2,1) 1.2")
_GPU_PIPELINES = Measured("XLA:GPU", "0.11.2", "2026-12-07", "the buffer assignment of 8B 4-layer GPipe and "
                          "interleaved steps at seq 8192 (the projection rests as its bf16 shard, one layer "
                          "gathered in bf16); with it the matrix's 20 pipeline rows (every schedule, remat none, "
                          "full and dots, ZeRO-0/1/3, 8B-70B and 4-layer programs) are within 10% of XLA's peak")
_GPU_LAYER = Measured("XLA:GPU", "0.11.2", "2026-12-07", "the matrix (dots as fitted first); full refitted from "
                      "1.2 to 1.1 on the rows the layer phase binds (seq 8192 and longer: FSDP at 4 layers, "
                      "pipelines, sequence and context parallelism)")
XLA_GPU = Constants(
    Compiler.XLA_GPU,
    # ``full`` and ``dots`` fitted (minimax on temp bytes) to the matrix's layouts that fit their target,
    # ``full`` again where the layer phase is the peak; ``none``'s rows are bound by the loss phase, so
    # XLA:CPU's coefficient is kept.
    activation_coefficients={RematPolicy.NONE: 0.82, RematPolicy.FULL: 1.1, RematPolicy.DOTS: 1.3},
    logits_fp32_copies=1,
    # One pass: one fp32 [tokens, vocab] buffer beside the bf16 logits, which the projection's fp32
    # gradient reuses (8B widths, 2 layers, FSDP 8, one row of 8,192 positions per device).
    one_pass_fp32_copies=1,
    one_pass_shares_gradient=True,
    tensor_reduction_buffers=0,
    cut_fp32_residuals=4,
    held=None,
    widened_chunk=False,
    copied_carries=False,
    projection_copies=1,
    update_in_place=True,
    checked_pipelines=True,
    gathered_copies=2,
    # The microbatch loop's copies of the stash: the layer scan's outputs zero-initialised outside it
    # and copied in, more where XLA double-buffers the loop (10B (1,2,4,1) ZeRO-2 dots: temp 44.6 GB,
    # 34.4 GB with --xla_gpu_enable_while_loop_double_buffering=false); none where ZeRO-3 gathers
    # tensor-parallel layers (8B and 10B on (1,4,2,1), 70B on (1,8,8,1)).
    accumulated_stash_copies=1.4,
    tensor_zero3_stash_copies=0,
    update_split_moments=1.5,
    pipeline_head_copies=0,
    measured={"logits_fp32_copies": _GPU_VOCAB_CHUNKS, "cut_fp32_residuals": _GPU_KEPT,
              "one_pass_fp32_copies": _GPU_ONE_PASS, "one_pass_shares_gradient": _GPU_ONE_PASS,
              "activation_coefficients": _GPU_LAYER, "accumulated_stash_copies": _GPU_ACCUMULATION,
              "tensor_zero3_stash_copies": _GPU_ACCUMULATION,
              "update_split_moments": _GPU_UPDATE, "pipeline_head_copies": _GPU_PIPELINES,
              "checked_pipelines": _GPU_PIPELINES,
              **dict.fromkeys(("tensor_reduction_buffers", "held", "widened_chunk", "copied_carries",
                               "projection_copies", "update_in_place", "gathered_copies"), _GPU_DEC07)},
)
TABLES: dict[Compiler, Constants] = {Compiler.XLA_CPU: XLA_CPU, Compiler.XLA_GPU: XLA_GPU}
# XLA:CPU's, for the CPU tests that bound a loss phase's buffers (tests/test_chunked_loss.py).
LOGITS_FP32_COPIES = XLA_CPU.logits_fp32_copies
