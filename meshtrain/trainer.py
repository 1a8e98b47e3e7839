"""The sharded train state and the one train step ``(state, batch) -> (state, metrics)``.

Order of application inside the step: precision cast of the master weights -> forward/backward per
accumulation microbatch, through the pipeline schedule when ``mesh.stage`` > 1 (activations
constrained by the rules, layers rematerialised by the model's policy) -> gradient accumulation in
the parameters' sharding -> unscale/finite check -> AdamW update.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.optim import OptimizerConfig, make_optimizer
from meshtrain.parallel.accumulate import Batch, accumulate_gradients, split_microbatches
from meshtrain.parallel.offload import DEVICE, HOST, OffloadConfig, check_host_memory, with_memory_kind
from meshtrain.parallel.pipeline import LayerOrder, PipelineConfig, make_value_and_grad, pipeline_rules
from meshtrain.parallel.rules import ShardingRules
from meshtrain.parallel.sharding import (activation_sharding, batch_sharding, data_parallel_size,
                                         optimizer_shardings, param_shardings)
from meshtrain.parallel.zero import ZeroConfig, zero_layout
from meshtrain.precision import LossScale, Precision, cast_floating, initial_loss_scale
from models.llama import Llama, LlamaConfig

Metrics = dict[str, jax.Array]


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


@struct.dataclass
class TrainState:
    """Everything that changes from step to step. Parameters and moments are fp32."""

    step: jax.Array  # i32 []
    params: nnx.State
    opt_state: optax.OptState
    loss_scale: LossScale
    skipped_steps: jax.Array  # i32 []: steps whose gradients were not finite (update skipped)


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum over [batch, length] of masked token cross-entropy, in fp32."""
    logits = logits.astype(jnp.float32)
    # A one-hot contraction rather than a gather: it partitions cleanly when vocab is split over
    # `tensor`, also inside a pipeline stage (XLA's partitioner aborts on the gather there).
    target_logits = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
    losses = jax.nn.logsumexp(logits, axis=-1) - target_logits
    return jnp.sum(losses * mask)


class Trainer:
    """Creates the born-sharded state and the train step for one model on one mesh."""

    def __init__(self, model_cfg: LlamaConfig, train_cfg: TrainConfig, opt_cfg: OptimizerConfig,
                 rules: ShardingRules, mesh: Mesh, pipeline_cfg: PipelineConfig = PipelineConfig(),
                 zero_cfg: ZeroConfig = ZeroConfig(), offload_cfg: OffloadConfig = OffloadConfig()):
        stages = mesh.shape["stage"]
        if stages > 1:
            rules = pipeline_rules(rules)
        self.model_cfg, self.train_cfg, self.rules, self.mesh = model_cfg, train_cfg, rules, mesh
        self.pipeline_cfg = pipeline_cfg
        self.layer_order = LayerOrder.of_run(stages, pipeline_cfg, model_cfg.num_layers)
        if train_cfg.precision is Precision.FP16 and mesh.devices.flat[0].platform == "cpu":
            raise ConfigError("train.precision", "fp16 needs a GPU (XLA:CPU has no fp16 matmul with fp32 "
                              "accumulation); use bf16 or fp32 on CPU")
        dp = data_parallel_size(rules, mesh)
        rows = dp * train_cfg.grad_accum
        if train_cfg.batch_size % rows:
            raise ConfigError("train.batch_size", f"{train_cfg.batch_size} must be divisible by the "
                              f"data-parallel size {dp} x train.grad_accum {train_cfg.grad_accum} = {rows}")
        if stages > 1:
            pipeline_cfg.validate(stages, model_cfg.num_layers, train_cfg.batch_size // rows)
        self.graphdef, self.abstract_params = nnx.split(nnx.eval_shape(self._new_model))
        if offload_cfg.optimizer:
            check_host_memory(mesh, "offload.optimizer")
        self.zero_cfg, self.offload_cfg = zero_cfg, offload_cfg
        self.layout = zero_layout(zero_cfg.stage, param_shardings(self.abstract_params, rules, mesh))
        self.param_shardings = self.layout.params
        self.tx, self.schedule = make_optimizer(opt_cfg, train_cfg.steps, self.abstract_params)
        replicated = NamedSharding(mesh, PartitionSpec())
        abstract_opt_state = jax.eval_shape(self.tx.init, self.abstract_params)
        # Where the optimizer state is updated (device memory) and where it rests between steps.
        self.optimizer_compute_shardings = optimizer_shardings(self.tx, abstract_opt_state,
                                                               self.layout.optimizer, mesh)
        self.state_shardings = TrainState(
            step=replicated, params=self.param_shardings,
            opt_state=with_memory_kind(self.optimizer_compute_shardings,
                                       HOST if offload_cfg.optimizer else DEVICE),
            loss_scale=jax.tree.map(lambda _: replicated, initial_loss_scale(train_cfg.uses_dynamic_loss_scale)),
            skipped_steps=replicated)
        self.batch_sharding = batch_sharding(rules, mesh)
        self.metrics_sharding = replicated
        self.train_step = jax.jit(
            self.step, in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated), donate_argnums=0)

    @property
    def pipeline_description(self) -> str:
        """One line: the pipeline schedule, its shape and its theoretical bubble ('' without one)."""
        stages = self.mesh.shape["stage"]
        if stages == 1:
            return ""
        cfg = self.pipeline_cfg
        return (f"pipeline: schedule {cfg.schedule.value}, {stages} stages x {cfg.chunks_per_stage} "
                f"virtual, {cfg.microbatches} microbatches, theoretical bubble "
                f"{cfg.bubble_fraction(stages):.1%}")

    def _new_model(self, seed: int = 0) -> Llama:
        return Llama(self.model_cfg, rngs=nnx.Rngs(seed))

    def _fresh_state(self, seed: int) -> TrainState:
        params = self.layer_order.to_storage(nnx.state(self._new_model(seed)))
        return TrainState(step=jnp.int32(0), params=params, opt_state=self.tx.init(params),
                          loss_scale=initial_loss_scale(self.train_cfg.uses_dynamic_loss_scale),
                          skipped_steps=jnp.int32(0))

    def init_state(self, seed: int) -> TrainState:
        """A fresh state created directly in its shardings (no full copy on any device)."""
        return jax.jit(lambda: self._fresh_state(seed), out_shardings=self.state_shardings)()

    def adopt_layer_order(self, state: TrainState, stored_in: LayerOrder) -> TrainState:
        """A restored ``state`` whose layers were stored in ``stored_in`` (another pipeline layout),
        in this trainer's layer order and shardings."""
        if stored_in == self.layer_order:
            return state
        return jax.jit(lambda s: stored_in.convert(s, self.layer_order), out_shardings=self.state_shardings,
                       donate_argnums=0)(state)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, without allocating it (AOT compile, restore)."""
        shapes = jax.eval_shape(lambda: self._fresh_state(0))
        return jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                                                         sharding=sharding),
                            shapes, self.state_shardings)

    def abstract_batch(self) -> Batch:
        """Shapes and shardings of one global batch {inputs, targets, mask}."""
        shape = (self.train_cfg.batch_size, self.model_cfg.seq_len)
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "mask": jnp.float32}
        return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
                for key, dtype in dtypes.items()}

    def gradients(self, state: TrainState, batch: Batch) -> tuple[jax.Array, nnx.State, jax.Array]:
        """Mean loss and its fp32 gradients (unscaled) on a global batch, and the target count.

        Microbatches of ``train.grad_accum`` are scanned; each runs through the pipeline schedule
        when ``mesh.stage`` > 1. Gradients of interleaved layers are in storage order.
        """
        compute_dtype = self.train_cfg.precision.compute_dtype
        target_count = jnp.maximum(jnp.sum(batch["mask"]), 1.0)

        def model_of(params: nnx.State) -> Llama:
            return nnx.merge(self.graphdef, cast_floating(params, compute_dtype))

        def loss_of_logits(logits: jax.Array, microbatch: Batch) -> jax.Array:
            loss = cross_entropy_sum(logits, microbatch["targets"], microbatch["mask"]) / target_count
            return state.loss_scale.scale_loss(loss)

        value_and_grad = make_value_and_grad(self.pipeline_cfg, self.mesh, model_of, loss_of_logits,
                                             activation_sharding(self.rules, self.mesh), compute_dtype)

        def constrain_grads(grads: nnx.State) -> nnx.State:
            return jax.lax.with_sharding_constraint(grads, self.layout.grads)

        scaled_loss, scaled_grads = accumulate_gradients(
            value_and_grad, state.params, split_microbatches(batch, self.train_cfg.grad_accum),
            constrain_grads)
        return (scaled_loss / state.loss_scale.scale, state.loss_scale.unscale(scaled_grads),
                target_count)

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        """One optimizer step on a global batch {inputs, targets, mask}: [batch, length] each."""
        loss, grads, target_count = self.gradients(state, batch)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        old_opt_state = jax.device_put(state.opt_state, self.optimizer_compute_shardings)
        updates, opt_state = self.tx.update(grads, old_opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        keep_if_finite = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = TrainState(
            step=state.step + 1,
            params=keep_if_finite(params, state.params),
            opt_state=keep_if_finite(opt_state, old_opt_state),
            loss_scale=state.loss_scale.adjust(finite),
            skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32))
        metrics = {"loss": loss, "grad_norm": grad_norm,
                   "lr": self.schedule(state.step), "loss_scale": state.loss_scale.scale,
                   "skipped_steps": new_state.skipped_steps, "target_tokens": target_count}
        return new_state, metrics
