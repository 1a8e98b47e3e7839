"""``TrainConfig``: the training loop's length, global batch, accumulation, precision and seed."""

from __future__ import annotations

import dataclasses
import enum
import re

import jax.numpy as jnp

from meshtrain.errors import ConfigError
from meshtrain.fp8_training import Fp8Recipe
from meshtrain.lora import LoraConfig
from meshtrain.precision import Precision
from models.common import coerce_enums
from models.kernels.fp8 import MatmulGroup


class NonFinitePolicy(str, enum.Enum):
    """What a non-finite loss or gradient norm does to the run (the step skips its update either way)."""

    SKIP = "skip"  # keep going; the skipped steps are counted in the metrics
    STOP = "stop"  # save the last good state and exit non-zero


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop: length, global batch, accumulation, precision, seed, logging cadence."""

    steps: int = 100
    batch_size: int = 16
    grad_accum: int = 1
    precision: Precision = Precision.FP32
    dynamic_loss_scale: bool | None = None  # None: on for fp16 only
    fp8: Fp8Recipe = dataclasses.field(default_factory=Fp8Recipe)  # the recipe of precision: fp8
    # Low-rank adapters on the layers' matmuls, every other parameter frozen (rank 0: off; meshtrain.lora).
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    seed: int = 0
    log_every: int = 10
    on_nonfinite: NonFinitePolicy = NonFinitePolicy.SKIP
    # Consecutive skipped steps after which a run stops (exit 3) with its checkpoints as they were
    # before them; 0 = no limit. fp16's loss scale starts at 2**15 and halves per skipped step.
    max_consecutive_skips: int = 10
    # Vocabulary entries in each chunk of the head and loss (meshtrain.loss; the largest divisor of the
    # vocabulary not above it); 0 = all at once, in one pass whose backward recomputes nothing. None:
    # chosen for the devices by the memory estimate (meshtrain.planner.estimate.choose_loss_chunk): one
    # pass where the step then fits the devices' memory for certain, else the largest chunk (of at
    # least 1,024 entries) that needs no more memory than the smallest. A chunked head's backward
    # recomputes its matmul once (a third more head FLOPs) whatever the chunk.
    loss_chunk: int | None = None
    # Steps to trace with jax.profiler into run.dir/profile: "5-8" (first-last, 1-based) or 5; None = off.
    profile_steps: str | int | None = None

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """(first, last) step of the profiler trace, or None."""
        if self.profile_steps is None:
            return None
        if isinstance(self.profile_steps, int):
            return self.profile_steps, self.profile_steps
        first, _, last = self.profile_steps.partition("-")
        return int(first), int(last or first)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """What the forward and backward compute in: the precision's, or under fp8 the recipe's
        ``wide`` precision outside its FP8 matmuls."""
        return (self.fp8.wide if self.precision is Precision.FP8 else self.precision).compute_dtype

    @property
    def fp8_groups(self) -> frozenset[MatmulGroup]:
        """The groups of layer matmuls that run in FP8: none unless ``precision: fp8``, then the
        recipe's (every group when it names none)."""
        if self.precision is not Precision.FP8:
            return frozenset()
        return frozenset(MatmulGroup if self.fp8.matmuls is None else self.fp8.matmuls)

    @property
    def uses_dynamic_loss_scale(self) -> bool:
        if self.dynamic_loss_scale is None:
            return self.precision.needs_loss_scaling
        return self.dynamic_loss_scale

    def __post_init__(self):
        coerce_enums(self, ConfigError)
        for name in ("steps", "batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be a positive integer, got {getattr(self, name)}")
        if self.precision is not Precision.FP8 and self.fp8 != Fp8Recipe():
            raise ConfigError("fp8", f"is set, but train.precision is {self.precision.value}: the recipe applies "
                              "under train.precision: fp8 only (set it, or drop train.fp8)")
        if self.lora.enabled and self.precision is Precision.FP8:
            raise ConfigError("lora", "with train.precision fp8 is not supported (FP8 frozen bases are not "
                              "implemented); use bf16 or fp32 with train.lora")
        if self.max_consecutive_skips < 0:
            raise ConfigError("max_consecutive_skips", f"must be >= 0 (0: no limit), got {self.max_consecutive_skips}")
        if self.loss_chunk is not None and self.loss_chunk < 0:
            raise ConfigError("loss_chunk", f"must be >= 0 vocabulary entries per chunk (0: all at once; null: "
                              f"chosen for the devices), got {self.loss_chunk}")
        if self.profile_steps is not None:
            text = str(self.profile_steps)
            if not re.fullmatch(r"[1-9][0-9]*(-[1-9][0-9]*)?", text) or self.profile_range[1] < self.profile_range[0]:
                raise ConfigError("profile_steps", f"got {text!r}; give a step (5) or a range first-last (5-8) "
                                  "of 1-based steps")
            if self.profile_range[1] > self.steps:
                raise ConfigError("profile_steps", f"{text} reaches past the run's last step (train.steps="
                                  f"{self.steps}), which would trace nothing there; give steps up to {self.steps}")
