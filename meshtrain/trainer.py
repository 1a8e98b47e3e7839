"""The sharded train state and the one train step ``(state, batch) -> (state, metrics)``.

Order of application inside the step: ring attention's balanced permutation of the positions (only
under ring attention) -> precision cast of the master weights (under fp8, the recipe's weights
passed as FP8 operands: ``meshtrain.fp8_training``) -> forward/backward per
accumulation microbatch, through the pipeline schedule when ``mesh.stage`` > 1 (activations
constrained by the rules, layers rematerialised by the model's policy, the head and the loss in
chunks of ``train.loss_chunk`` vocabulary entries, chosen for the devices where the config leaves it:
``meshtrain.loss``) -> gradient accumulation in
the gradients' sharding of the ZeRO stage (split over ``fsdp`` from ZeRO-2 on) -> unscale -> optimizer
update in place (and delayed scaling's amax histories), applied only where the loss, the gradient
norm and the FP8 amaxes are finite -> the new parameters and moments checked for finiteness
(``state_finite``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.fp8_training import Fp8Training
from meshtrain.lora import LoraTraining
from meshtrain.loss import Batch, Objective, chunk_size, with_ahead_targets
from meshtrain.mesh import device_memory_bytes
from meshtrain.optim import OptimizerConfig, descended_gradients, make_optimizer, sign_descent_rates
from meshtrain.parallel.accumulate import accumulate_gradients, split_microbatches
from meshtrain.parallel.activations import activation_sharding
from meshtrain.parallel.experts import describe_exchange
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.offload import DEVICE, HOST, check_host_memory, with_memory_kind
from meshtrain.parallel.pipeline import make_loss, make_value_and_grad
from meshtrain.parallel.ring_attention import balanced_order
from meshtrain.parallel.sharding import batch_sharding, named_shardings, optimizer_shardings
from meshtrain.parallel.zero import StateShardings
from meshtrain.planner.constants import Compiler
from meshtrain.planner.estimate import with_chosen_loss_chunk
from meshtrain.planner.roofline import Hardware
from meshtrain.precision import LossScale, Precision, cast_floating, initial_loss_scale
from meshtrain.xla_flags import step_compiler_options
from models.api import AUX_LOSS, MTP_LOSS, BlockedExperts, DecoderModel, PredictsAhead, RoutedExperts

Metrics = dict[str, jax.Array]


@struct.dataclass
class TrainState:
    """Everything that changes from step to step. Parameters and moments are fp32; under
    ``train.lora`` the parameters are frozen in the compute dtype and the adapters train."""

    step: jax.Array  # i32 []
    params: nnx.State
    opt_state: optax.OptState
    loss_scale: LossScale
    skipped_steps: jax.Array  # i32 []: steps whose gradients were not finite (update skipped)
    # train.precision fp8 with delayed scaling: each FP8 weight's amax history (meshtrain.fp8_training, nested
    # as the parameters); else empty.
    fp8: nnx.State = struct.field(default_factory=lambda: nnx.State({}))
    # train.lora: the low-rank adapters, which the optimizer trains (meshtrain.lora); else empty.
    adapters: nnx.State = struct.field(default_factory=lambda: nnx.State({}))


def check_expert_block(layout: Layout) -> None:
    """A ``ConfigError`` on ``model.expert_block`` (``models.api.BlockedExperts``) larger
    than the tokens of one step (``train.batch_size / train.grad_accum x model.seq_len``): no expert's
    rows fill a larger block, and its padding alone can outgrow what XLA can allocate."""
    model, train = layout.model, layout.train
    if not isinstance(model, BlockedExperts):
        return
    tokens = train.batch_size // train.grad_accum * model.seq_len
    if model.expert_block > tokens:
        raise ConfigError("model.expert_block", f"{model.expert_block:,} rows per block is more than the {tokens:,} "
                          f"tokens of one step (train.batch_size {train.batch_size} / train.grad_accum "
                          f"{train.grad_accum} x model.seq_len {model.seq_len}), which no expert's rows can fill; "
                          f"use 1 to {tokens:,}, or 0 to choose from the rows")


class ShardedState:
    """The train state of one ``Layout`` (``self.layout``) on one mesh: its optimizer, FP8 histories and
    LoRA adapters, the shardings of each part, and the state created in them or described abstractly.
    It reads the layout's model, rules, ZeRO stage, offload, precision, LoRA and steps, not its batch:
    the tools restore a run's checkpoint with it (``meshtrain.weights.loading.restore_run``).

    Raises:
      ConfigError: a parameter dimension that its split does not divide (``Layout.parameter_problems``),
        or ``offload.optimizer`` on devices without host memory.
    """

    def __init__(self, layout: Layout, mesh: Mesh, optimizer: OptimizerConfig = OptimizerConfig()):
        if dict(mesh.shape) != dict(layout.mesh_shape):
            raise ValueError(f"the layout is for mesh {dict(layout.mesh_shape)}, not {dict(mesh.shape)}")
        problems = layout.parameter_problems()
        if problems:
            raise problems[0].error()
        if layout.offload.optimizer:
            check_host_memory(mesh, "offload.optimizer")
        self.layout, self.mesh = layout, mesh
        self.family, self.abstract_params = layout.family, layout.abstract_params
        self.graphdef = layout.graphdef
        self.rules, self.layer_order = layout.rules, layout.layer_order
        self.part_shardings = named_state_shardings(layout.state_specs(), mesh)
        self.param_shardings = self.part_shardings.params
        self.fp8 = (Fp8Training(layout.train.fp8, self.abstract_params, self.family)
                    if layout.train.precision is Precision.FP8 else None)
        self.lora = (LoraTraining(layout.train.lora, self.abstract_params, self.family)
                     if layout.train.lora.enabled else None)
        # What the optimizer trains (the parameters, or under LoRA the adapters) and its shardings.
        self.abstract_trainable = self.lora.abstract_adapters() if self.lora else self.abstract_params
        self.trainable_shardings = (named_state_shardings(layout.state_specs(params=self.abstract_trainable), mesh)
                                    if self.lora else self.part_shardings)
        self.tx, self.schedule = make_optimizer(optimizer, layout.train.steps, self.abstract_trainable)
        self.replicated = replicated = NamedSharding(mesh, PartitionSpec())  # scalars: step, metrics
        abstract_opt_state = jax.eval_shape(self.tx.init, self.abstract_trainable)
        # Where the optimizer state is updated (device memory) and where it rests between steps.
        self.optimizer_compute_shardings = optimizer_shardings(abstract_opt_state, self.abstract_trainable,
                                                               self.trainable_shardings.optimizer, mesh)
        self.state_shardings = TrainState(
            step=replicated, params=self.param_shardings,
            opt_state=with_memory_kind(self.optimizer_compute_shardings,
                                       HOST if layout.offload.optimizer else DEVICE),
            loss_scale=jax.tree.map(lambda _: replicated, initial_loss_scale(layout.train.uses_dynamic_loss_scale)),
            skipped_steps=replicated,
            fp8=self.fp8.history_shardings(self.param_shardings) if self.fp8 else nnx.State({}),
            adapters=self.trainable_shardings.params if self.lora else nnx.State({}))

    def fresh_state(self, seed: int) -> TrainState:
        """The state drawn from ``seed``, to trace: its values do not depend on the shardings that
        ``init_state`` creates it in (JAX's partitionable random bits), so one device computes them too."""
        params = self.layer_order.to_storage(nnx.state(self.family.build(self.layout.model, seed)))
        adapters = self.layer_order.to_storage(self.lora.initial_adapters(seed)) if self.lora else nnx.State({})
        return TrainState(step=jnp.int32(0), params=self.held(params),
                          opt_state=self.tx.init(adapters if self.lora else params),
                          loss_scale=initial_loss_scale(self.layout.train.uses_dynamic_loss_scale),
                          skipped_steps=jnp.int32(0), fp8=self.fp8.initial_histories() if self.fp8 else nnx.State({}),
                          adapters=adapters)

    def held(self, params: nnx.State) -> nnx.State:
        """The parameters as the state holds them: fp32 masters, or under LoRA frozen in the compute dtype."""
        return cast_floating(params, self.layout.train.compute_dtype) if self.lora else params

    def model_params(self, state: TrainState, dtype: jnp.dtype | None = None) -> nnx.State:
        """The model's parameters of ``state`` as one tree (evaluation, sampling, export): its
        parameters, or under LoRA the frozen ones with the adapters merged in, in ``dtype`` (default:
        as held: the compute dtype; the tools ask for fp32)."""
        if not self.lora:
            return state.params
        return self._merge(None if dtype is None else jnp.dtype(dtype))(state.params, state.adapters)

    @functools.cache  # noqa: B019 - one jitted merge per dtype for the state's life (evaluations reuse it)
    def _merge(self, dtype: jnp.dtype | None):
        return jax.jit(functools.partial(self.lora.merged, dtype=dtype), out_shardings=self.param_shardings)

    def init_state(self, seed: int) -> TrainState:
        """A fresh state created directly in its shardings (no full copy on any device)."""
        return jax.jit(lambda: self.fresh_state(seed), out_shardings=self.state_shardings)()

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, without allocating it (AOT compile, restore)."""
        shapes = jax.eval_shape(lambda: self.fresh_state(0))
        return jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                                                         sharding=sharding),
                            shapes, self.state_shardings)


class Trainer(ShardedState):
    """The train and evaluation steps of one model on one mesh, as its ``Layout`` (``self.layout``)
    lays them out, over the born-sharded state of ``ShardedState``."""

    def __init__(self, layout: Layout, mesh: Mesh, optimizer: OptimizerConfig = OptimizerConfig(),
                 device_memory: int | None = None):
        """``device_memory``: bytes per device that a ``train.loss_chunk`` left to the devices (null) is
        chosen for (default: what ``mesh``'s devices report; ``meshtrain.gpu_compile`` gives its target's)."""
        device = mesh.devices.flat[0]
        if layout.train.precision is Precision.FP16 and device.platform == "cpu":
            raise ConfigError("train.precision", "fp16 needs a GPU (XLA:CPU has no fp16 matmul with fp32 "
                              "accumulation); use bf16 or fp32 on CPU")
        problems = layout.problems(parameters=False)  # the parameters' own: ShardedState's, after these
        if problems:
            raise problems[0].error()
        check_expert_block(layout)
        self.loss_chunk_chosen = layout.train.loss_chunk is None
        layout = with_chosen_loss_chunk(layout, Hardware(compiler=Compiler.of_platform(device.platform)),
                                        device_memory_bytes(device) if device_memory is None else device_memory)
        super().__init__(layout, mesh, optimizer)
        model = nnx.merge(self.graphdef, self.abstract_params)
        # Multi-token prediction's depths (models.api.PredictsAhead): the batch carries their targets.
        self.ahead_depths = model.ahead_depths if isinstance(model, PredictsAhead) else 0
        self.sign_rates = sign_descent_rates(self.abstract_trainable)
        replicated = self.replicated
        self.batch_sharding = batch_sharding(self.rules, mesh)
        self.metrics_sharding = replicated
        self.train_step = jax.jit(
            self.step, in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated), donate_argnums=0,
            compiler_options=step_compiler_options(layout))
        self.eval_step = jax.jit(self.evaluate, in_shardings=(self.param_shardings, self.batch_sharding),
                                 out_shardings=replicated)

    def describe_kernels(self, packed: bool) -> list[str]:
        """The start-up lines saying what runs on this mesh: the FP8 recipe, the attention kernel for
        rows packed from documents (``packed``) or not, each split experts' exchange, the pipeline
        (the lines that apply). ``ConfigError`` on ``model.attention`` for a kernel that cannot run here."""
        model, precision = self.layout.model, self.layout.train.precision
        lines = [self.fp8 and self.fp8.describe(),
                 self.lora and self.lora.describe(self.layout.train.compute_dtype),
                 activation_sharding(self.rules, self.mesh).describe_attention(model.attention_spec, packed,
                                                                               precision.compute_dtype),
                 *[describe_exchange(self.rules, self.mesh, axis, isinstance(model, RoutedExperts)
                                     and model.sorted_dispatch) for axis in self.layout.expert_axes],
                 self.grouped_kernel_line(),
                 self.pipeline_description,
                 self.loss_description]
        return [line for line in lines if line]

    def grouped_kernel_line(self) -> str:
        """The experts' grouped-matmul kernel on this mesh's devices ('' without a sorted dispatch);
        ``ConfigError`` on ``model.grouped_matmul`` for a kernel that cannot run here."""
        model = self.layout.model
        if not (isinstance(model, BlockedExperts) and isinstance(model, RoutedExperts) and model.sorted_dispatch):
            return ""
        try:
            return model.grouped_spec.describe(self.mesh.devices.flat[0].platform, self.layout.train.compute_dtype)
        except ValueError as err:
            raise ConfigError("model.grouped_matmul", str(err).removeprefix("model.grouped_matmul=")) from None

    @property
    def loss_description(self) -> str:
        """One line: the chunks of the vocabulary the head and the loss run in (``meshtrain.loss``), and
        who chose them."""
        vocab = self.layout.model.vocab_size
        chunk = chunk_size(vocab, self.layout.train.loss_chunk, self.layout.vocab_ways)
        how = ("one pass (its backward recomputes nothing)" if chunk == vocab else
               f"{vocab // chunk} chunks of {chunk} entries (its backward recomputes the logits)")
        who = ("chosen for these devices' memory by the estimate; set train.loss_chunk to fix it"
               if self.loss_chunk_chosen else f"train.loss_chunk={self.layout.train.loss_chunk}")
        return f"loss: the head over a vocabulary of {vocab} in {how}: {who}"

    @property
    def pipeline_description(self) -> str:
        """One line: the pipeline schedule, its shape and its theoretical bubble ('' without one)."""
        stages = self.mesh.shape["stage"]
        if stages == 1:
            return ""
        cfg = self.layout.pipeline
        return (f"pipeline: schedule {cfg.schedule.value}, {stages} stages x {cfg.chunks_per_stage} "
                f"virtual, {cfg.microbatches} microbatches: {cfg.schedule_table(stages).describe()}")

    def abstract_batch(self, documents: bool = False) -> Batch:
        """Shapes and shardings of one global batch {inputs, targets, mask}, and with ``documents``
        (rows packed from several documents) {positions, segments}."""
        shape = (self.layout.train.batch_size, self.layout.model.seq_len)
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "mask": jnp.float32}
        if documents:
            dtypes.update(positions=jnp.int32, segments=jnp.int32)
        return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
                for key, dtype in dtypes.items()}

    def _ordered(self, batch: Batch) -> Batch:
        """The batch with its positions permuted into ring attention's balanced order (when the
        layout runs ring attention with ``sharding.balance_ring``), positions and segments made
        explicit so that rotary angles, causality and the loss follow the tokens; else unchanged.
        The loss, a sum over tokens, does not depend on the order."""
        axis = self.rules.ring_axis
        if axis is None or self.mesh.shape[axis] == 1 or not self.rules.balance_ring:
            return batch
        rows, length = batch["inputs"].shape
        order = jnp.asarray(balanced_order(length, self.mesh.shape[axis]))
        batch = {"positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length)),
                 "segments": jnp.ones((rows, length), jnp.int32), **batch}
        return {key: value[:, order] for key, value in batch.items()}

    def _model_of(self, params: nnx.State) -> DecoderModel:
        """The model on ``params`` (already in the compute dtype: the pipeline casts the fp32 master
        weights once per step and differentiates through the cast); under LoRA only the adapters
        carry gradients."""
        return nnx.merge(self.graphdef, self.lora.frozen(params) if self.lora else params)

    def evaluate(self, params: nnx.State, batch: Batch) -> Metrics:
        """Forward only: the summed token cross-entropy of a global batch (``loss_sum``, fp32) and its
        target count (``target_tokens``), in ``train.grad_accum`` microbatches like a train step and
        through the same pipeline schedule's forward. Aux losses are not part of it."""
        compute_dtype = self.layout.train.compute_dtype
        batch = self._ordered(batch)
        objective = Objective.evaluation(self.layout.train.loss_chunk, self.layout.vocab_ways)
        loss = make_loss(self.layout.pipeline, self.mesh, self._model_of, objective,
                         activation_sharding(self.rules, self.mesh), compute_dtype)

        def add_microbatch(total: jax.Array, microbatch: Batch) -> tuple[jax.Array, None]:
            return total + loss(params, microbatch)[0], None

        total, _ = jax.lax.scan(add_microbatch, jnp.zeros((), jnp.float32),
                                split_microbatches(batch, self.layout.train.grad_accum))
        return {"loss_sum": total, "target_tokens": jnp.sum(batch["mask"])}

    def gradients(self, state: TrainState, batch: Batch
                  ) -> tuple[jax.Array, nnx.State, jax.Array, Metrics, nnx.State]:
        """Mean loss and its fp32 gradients (unscaled; of the adapters under LoRA) on a global batch,
        the target count, the layers' statistics (every aux term of ``DecoderModel.run_layers`` but the
        loss, as a mean over the batch's rows) and, under fp8, the step's amaxes per FP8 weight (else an
        empty tree).

        Microbatches of ``train.grad_accum`` are scanned; each runs through the pipeline schedule
        when ``mesh.stage`` > 1. Gradients of interleaved layers are in storage order.
        """
        compute_dtype = self.layout.train.compute_dtype
        batch = self._ordered(with_ahead_targets(batch, self.ahead_depths))
        target_count = jnp.maximum(jnp.sum(batch["mask"]), 1.0)
        rows = batch["mask"].shape[0]

        objective = Objective.training(target_count, rows, state.loss_scale, self.layout.train.loss_chunk,
                                       self.layout.vocab_ways)
        value_and_grad = make_value_and_grad(self.layout.pipeline, self.mesh, self._model_of, objective,
                                             activation_sharding(self.rules, self.mesh), compute_dtype)

        params, grad_shardings = state.params, self.part_shardings.grads
        if self.lora:
            key = jax.random.fold_in(jax.random.key(self.layout.train.seed), state.step)
            params = self.lora.attach(state.params, state.adapters,
                                      self.lora.dropout_seeds(key, self.layer_order.to_storage))
            grad_shardings = self.lora.attach(grad_shardings, self.trainable_shardings.grads,
                                              self.lora.seed_shardings(self.param_shardings))
        if self.fp8:
            params = self.fp8.attach(state.params, state.fp8)
            grad_shardings = self.fp8.attach(grad_shardings, self.fp8.history_shardings(self.param_shardings),
                                             self.fp8.observed_shardings(self.param_shardings))

        def constrain_grads(grads: nnx.State) -> nnx.State:
            return jax.lax.with_sharding_constraint(grads, grad_shardings)

        scaled_loss, aux, scaled_grads = accumulate_gradients(
            value_and_grad, params, split_microbatches(batch, self.layout.train.grad_accum), constrain_grads)
        scaled_grads, observed = self.fp8.split(scaled_grads) if self.fp8 else (scaled_grads, nnx.State({}))
        if self.lora:
            scaled_grads = self.lora.split(scaled_grads, state.adapters)
        # MTP_LOSS is already a share of the (scaled) loss; the rest are sums over rows.
        statistics = {name: state.loss_scale.unscale(value) if name == MTP_LOSS else value / rows
                      for name, value in aux.items() if name != AUX_LOSS}
        return (state.loss_scale.unscale(scaled_loss), state.loss_scale.unscale(scaled_grads),
                target_count, statistics, observed)

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        """One optimizer step on a global batch {inputs, targets, mask} (and {positions, segments}
        when its rows are packed from documents): [batch, length] each.

        The update is applied (in place, inside a ``lax.cond``) only when the loss and the gradient
        norm are finite; otherwise params and moments stay as they were and ``skipped_steps`` counts
        it. What was applied is then measured: ``state_finite`` is whether every new parameter and
        moment is finite (the loop never saves a state without it; docs/checkpoints.md).
        """
        loss, grads, target_count, statistics, observed = self.gradients(state, batch)
        grad_norm = optax.tree.norm(descended_gradients(grads, self.sign_rates))
        inputs_finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if self.fp8:
            inputs_finite &= self.fp8.finite(observed)
            statistics = {**statistics, **self.fp8.metrics(observed)}
        histories = state.fp8
        if self.fp8 and self.fp8.delayed:
            histories = jax.tree.map(lambda new, old: jnp.where(inputs_finite, new, old),
                                     self.fp8.updated(state.fp8, observed), state.fp8)
        old_opt_state = jax.device_put(state.opt_state, self.optimizer_compute_shardings)

        def apply_update(params: nnx.State, opt_state: optax.OptState) -> tuple[nnx.State, optax.OptState]:
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        trainable = state.adapters if self.lora else state.params
        trained, opt_state = jax.lax.cond(inputs_finite, apply_update, lambda *old: old, trainable, old_opt_state)
        new_state = TrainState(
            step=state.step + 1, params=state.params if self.lora else trained, opt_state=opt_state,
            loss_scale=state.loss_scale.adjust(inputs_finite),
            skipped_steps=state.skipped_steps + (~inputs_finite).astype(jnp.int32), fp8=histories,
            adapters=trained if self.lora else state.adapters)
        metrics = {"loss": loss, "grad_norm": grad_norm, "state_finite": all_finite((trained, opt_state)),
                   "lr": self.schedule(state.step), "loss_scale": state.loss_scale.scale,
                   "skipped_steps": new_state.skipped_steps, "update_skipped": ~inputs_finite,
                   "target_tokens": target_count, **statistics}
        return new_state, metrics


def named_state_shardings(specs: StateShardings, mesh: Mesh) -> StateShardings:
    """``specs`` (PartitionSpecs) as NamedShardings on ``mesh``."""
    return StateShardings(*(named_shardings(part, mesh) for part in (specs.params, specs.grads, specs.optimizer)))


def all_finite(tree) -> jax.Array:
    """bool []: whether every element of every floating-point leaf of ``tree`` is finite."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))
