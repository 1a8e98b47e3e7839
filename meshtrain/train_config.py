"""``TrainConfig``: the training loop's length, global batch, accumulation, precision and seed."""

from __future__ import annotations

import dataclasses
import enum

from meshtrain.errors import ConfigError
from meshtrain.precision import Precision


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
    seed: int = 0
    log_every: int = 10
    on_nonfinite: NonFinitePolicy = NonFinitePolicy.SKIP

    @property
    def uses_dynamic_loss_scale(self) -> bool:
        if self.dynamic_loss_scale is None:
            return self.precision.needs_loss_scaling
        return self.dynamic_loss_scale

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be a positive integer, got {getattr(self, name)}")
