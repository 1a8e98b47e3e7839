"""The optimizer (AdamW, Lion, Adafactor or Muon) with its learning-rate schedule (warmup, then cosine, linear,
constant, warmup-stable-decay or inverse square root), global-norm clipping and a weight-decay mask;
sign descent for a model's ``SignDescent`` variables."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from meshtrain.errors import ConfigError
from models.common import SignDescent, coerce_enums, logical_axes_of


class OptimizerName(str, enum.Enum):
    """``optimizer.name``. ADAMW: optax's AdamW. LION: optax's Lion (``b1``, ``b2``; sign updates, so
    a learning rate ~3-10x below AdamW's). ADAFACTOR: optax's Adafactor (factored second moments,
    the update scaled by the parameter's scale; ``weight_decay`` as its decay rate). MUON:
    optax.contrib's Muon on the matrices (Newton-Schulz orthogonalised momentum with ``b2`` as its
    momentum), AdamW (``b1``, ``b2``) on the rest (``muon_matrices``)."""

    ADAMW = "adamw"
    LION = "lion"
    ADAFACTOR = "adafactor"
    MUON = "muon"


class LRSchedule(str, enum.Enum):
    """``optimizer.schedule``, after ``warmup_steps`` of linear warmup from 0 to ``learning_rate``.
    COSINE: cosine decay to ``min_lr_ratio x learning_rate`` at ``train.steps``. LINEAR: linear decay
    to it. CONSTANT: ``learning_rate`` to the end. WSD (warmup-stable-decay): constant, then a linear
    decay to ``min_lr_ratio x learning_rate`` over the last ``decay_fraction`` of the steps.
    INVERSE_SQRT: ``learning_rate x sqrt(warmup_steps / step)`` after the warmup (``warmup_steps``
    at least 1)."""

    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"
    WSD = "wsd"
    INVERSE_SQRT = "inverse_sqrt"


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and its hyper-parameters; the schedule runs over ``train.steps``."""

    name: OptimizerName = OptimizerName.ADAMW
    learning_rate: float = 3e-3
    schedule: LRSchedule = LRSchedule.COSINE
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # WSD: the share of the steps in the final decay
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0

    def __post_init__(self):
        coerce_enums(self, ConfigError)
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError("decay_fraction", f"must be in (0, 1] (the share of the steps WSD decays over), "
                              f"got {self.decay_fraction}")
        if self.learning_rate <= 0:
            raise ConfigError("learning_rate", f"must be > 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ConfigError("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        # b1 or b2 of 1 divides by 0 in Adam's bias correction, eps of 0 makes 0 / 0 of a parameter
        # whose gradient and moments are 0: a non-finite update from finite gradients.
        for name in ("b1", "b2"):  # the step computes in fp32, where 1 - 1e-9 is 1
            if not (getattr(self, name) >= 0 and np.float32(getattr(self, name)) < 1):
                raise ConfigError(name, f"must be in [0, 1) as a 32-bit float (at most 0.99999994), "
                                        f"got {getattr(self, name)}")
        if not self.eps > 0:
            raise ConfigError("eps", f"must be > 0, got {self.eps}")
        for name in ("weight_decay", "clip_norm"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """0 -> learning_rate over ``warmup_steps``, then ``cfg.schedule`` (``LRSchedule``) to ``total_steps``."""
    warmup = min(cfg.warmup_steps, total_steps)
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    if cfg.schedule is LRSchedule.COSINE:
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                                  decay_steps=max(total_steps, warmup + 1), end_value=floor)
    ramp = optax.linear_schedule(0.0, peak, warmup)
    after = {LRSchedule.LINEAR: optax.linear_schedule(peak, floor, max(total_steps - warmup, 1)),
             LRSchedule.CONSTANT: optax.constant_schedule(peak),
             LRSchedule.INVERSE_SQRT: lambda step: peak * jnp.sqrt(
                 max(warmup, 1) / jnp.maximum(jnp.asarray(step, jnp.float32) + max(warmup, 1), max(warmup, 1)))}
    if cfg.schedule is LRSchedule.WSD:
        decay = max(1, round(cfg.decay_fraction * (total_steps - warmup)))
        stable = max(total_steps - warmup - decay, 0)
        return optax.join_schedules([ramp, optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
                                    [warmup, warmup + stable])
    return optax.join_schedules([ramp, after[cfg.schedule]], [warmup])


def weight_decay_mask(abstract_params: nnx.State) -> nnx.State:
    """True for matrices (two or more logical axes besides ``layers``); norm scales are not decayed."""

    def decays(variable: nnx.Variable) -> nnx.Variable:
        return variable.replace(len([a for a in logical_axes_of(variable) if a != "layers"]) >= 2)

    return jax.tree.map(decays, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimizerConfig, total_steps: int,
                   abstract_params: nnx.State) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The AdamW transformation (clipping first) and its learning-rate schedule; the model's
    ``SignDescent`` variables, if any, move by their rate times the sign of their gradient instead."""
    schedule = learning_rate_schedule(cfg, total_steps)
    decay = weight_decay_mask(abstract_params)
    update = {
        OptimizerName.ADAMW: lambda: optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                                 weight_decay=cfg.weight_decay, mask=decay),
        OptimizerName.LION: lambda: optax.lion(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                                               mask=decay),
        OptimizerName.ADAFACTOR: lambda: optax.adafactor(schedule, weight_decay_rate=cfg.weight_decay or None,
                                                         weight_decay_mask=decay),
        OptimizerName.MUON: lambda: optax.contrib.muon(
            schedule, beta=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, weight_decay_mask=decay,
            adam_b1=cfg.b1, adam_b2=cfg.b2, adam_weight_decay=cfg.weight_decay,
            muon_weight_dimension_numbers=muon_matrices(abstract_params)),
    }[cfg.name]()
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm > 0 else optax.identity(), update)
    rates = sign_descent_rates(abstract_params)
    return (with_sign_descent(tx, rates) if any(jax.tree.leaves(rates)) else tx), schedule


def muon_matrices(abstract_params: nnx.State) -> nnx.State:
    """Per parameter, Muon's ``MuonDimensionNumbers`` (which axes are the matrix's rows and columns;
    ``layers`` and ``experts`` are batch axes), or None for AdamW: parameters with fewer than two
    such axes (norm scales), the embedding and head (``vocab``), as Muon's authors do, and
    ``SignDescent`` variables. A last axis ``embed`` (or ``expert_embed``) is the matrix's output
    (an out-projection); else the first axis is its input."""
    from optax.contrib import MuonDimensionNumbers

    def dims(variable: nnx.Variable) -> nnx.Variable:
        axes = logical_axes_of(variable)
        free = [i for i, axis in enumerate(axes) if axis not in ("layers", "experts")]
        if len(free) < 2 or "vocab" in axes or isinstance(variable, SignDescent):
            return variable.replace(None)
        if axes[free[-1]] in ("embed", "expert_embed"):
            return variable.replace(MuonDimensionNumbers(tuple(free[:-1]), (free[-1],)))
        return variable.replace(MuonDimensionNumbers((free[0],), tuple(free[1:])))

    return jax.tree.map(dims, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def sign_descent_rates(abstract_params: nnx.State) -> Any:
    """Per variable of ``abstract_params``: its rate if it is a ``SignDescent`` variable, else 0."""
    return jax.tree.map(lambda v: v.get_metadata()["rate"] if isinstance(v, SignDescent) else 0.0,
                        abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def descended_gradients(grads: nnx.State, rates: Any) -> nnx.State:
    """``grads`` with the ``SignDescent`` variables' (``rates`` > 0) set to zero: what the optimizer
    proper (and the gradient norm) sees."""
    return jax.tree.map(lambda rate, g: g.replace(jnp.zeros_like(g.get_value())) if rate else g, rates, grads)


def with_sign_descent(inner: optax.GradientTransformation, rates: Any) -> optax.GradientTransformation:
    """``inner`` on every variable but the ``SignDescent`` ones (their gradients zeroed for it, so
    that clipping and the moments never see them), which move by ``-rate * sign(gradient)``."""

    def update(updates, state, params=None):
        inner_updates, state = inner.update(descended_gradients(updates, rates), state, params)
        signed = lambda rate, u, g: u.replace(-rate * jnp.sign(g.get_value())) if rate else u
        return jax.tree.map(signed, rates, inner_updates, updates), state

    return optax.GradientTransformation(inner.init, update)
