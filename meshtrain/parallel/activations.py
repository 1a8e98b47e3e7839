"""The model's door to the mesh: ``MeshActivationSharding`` is the ``models.common.ActivationSharding``
a model applies to its activations on a mesh under a rules table: sharding constraints by logical
axes, the embedding lookup, the attention scheme the rules imply (ring attention where the keys stay
split along the sequence, ``ring_attention.py``; queries local under context parallelism) and the
experts' exchange (``experts.py``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.parallel import experts
from meshtrain.parallel.ring_attention import ring_attention, ring_attention_in_stage
from meshtrain.parallel.rules import ShardingRules, drop_axes, mesh_axes_of
from models.common import ActivationSharding, ExpertCompute, LogicalAxes
from models.kernels.attention import AttentionKernel, AttentionSpec, attend, blockwise_attention, cudnn_refusal
from models.kernels.tokamax_attention import tokamax_refusal


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def varying_summed_in_fp32(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` (invariant over the manual ``axes`` of a ``shard_map``) marked as varying over them; its
    cotangent is summed over ``axes`` in fp32 and cast back (XLA:CPU's compiler aborts on a bf16
    psum inside a partially manual shard_map; the values themselves stay in their dtype)."""
    return jax.lax.pcast(x, axes, to="varying")


def _varying_forward(x, axes):
    return varying_summed_in_fp32(x, axes), None


def _varying_backward(axes, _, cotangent):
    return (jax.lax.psum(cotangent.astype(jnp.float32), axes).astype(cotangent.dtype),)


varying_summed_in_fp32.defvjp(_varying_forward, _varying_backward)


class MeshActivationSharding:
    """What a model applies to its activations on ``mesh`` under ``rules`` (``ActivationSharding``):
    sharding constraints by logical axes, and the attention scheme the rules imply."""

    def __init__(self, rules: ShardingRules, mesh: Mesh):
        self.rules, self.mesh = rules, mesh
        # Every kernel is chosen from the mesh's devices, never from JAX's default backend: a mesh of
        # compile-only GPUs on a CPU host gets the GPU's kernels.
        self.platform = mesh.devices.flat[0].platform
        axis = rules.ring_axis
        self.ring = axis if axis is not None and mesh.shape[axis] > 1 else None
        # Context parallelism with the keys gathered: the mesh axes splitting the queries.
        self.query_axes = () if self.ring else tuple(
            a for a in mesh_axes_of(rules.activation_spec(("length",))[0]) if mesh.shape[a] > 1)
        # Where the fused kernels cannot be partitioned (jax 0.11.2). jax's cuDNN partitioner refuses
        # queries split along the sequence ("Sharding on sequence dim is not allowed") and fails inside a
        # shard_map over ``stage`` (it is handed a GSPMDSharding, which has no ``spec``); tokamax's kernel
        # runs in a shard_map over the rows and heads (``_attend_tokamax``), which cannot nest in a
        # stage's, and needs every key of its queries' rows.
        self.layout_refuses_fused = ("queries split along the sequence (context parallelism)" if self.query_axes
                                     else "inside pipeline stages" if mesh.shape.get("stage", 1) > 1 else "")

    @property
    def lockstep_stages(self) -> bool:
        """Whether the layers run collectives that every device of the mesh must enter at once, so
        that a pipeline runs every slot on every stage each tick (``meshtrain.parallel.executor``):
        ring attention inside a stage moves its blocks by XLA's collective-permute, whose
        rendezvous on XLA:CPU spans the devices of every stage (a stage skipping it deadlocks the
        others)."""
        return self.ring is not None

    def __call__(self, x: jax.Array, axes: LogicalAxes) -> jax.Array:
        # Inside a shard_map (a pipeline stage) the traced mesh has ``stage`` manual: use it.
        traced_mesh = jax.sharding.get_abstract_mesh()
        target = self.mesh if traced_mesh.empty else traced_mesh
        return jax.lax.with_sharding_constraint(x, NamedSharding(target, self.rules.activation_spec(axes)))

    def lookup(self, table: jax.Array, ids: jax.Array, axes: LogicalAxes) -> jax.Array:
        """``table[ids]`` [batch, length, width] laid out by ``axes``.

        The table stays as its parameter rules split it (``vocab`` over V, the width over W): the
        ids are gathered over W (they keep any other split), every device looks them up in its
        own ``[vocab / V, width / W]`` slice (rows of other slices masked to zero), and the rows
        are summed over V and resharded to ``axes``: ``[batch, length, width]`` bytes move instead
        of the whole table every step, and its gradient's scatter-add stays local.

        Inside a pipeline stage (a manual ``stage`` axis) the vocab is gathered first: each device
        looks its ids up in a ``[vocab, width / W]`` table (V times its parameter shard, in the
        first stage's forward and backward), no sum over V: XLA's partitioner aborts on a gather
        from a table with a split vocab there, and moving the width onto other mesh axes deadlocks
        in the branch only the first stage takes (docs/pipeline.md has the versions)."""
        traced_mesh = jax.sharding.get_abstract_mesh()
        table_spec = self.rules.param_spec(("vocab", "embed"))
        if not traced_mesh.empty:
            table_spec = PartitionSpec(None, table_spec[1])
        ids_spec = drop_axes(self.rules.activation_spec(("batch", "length")), set(mesh_axes_of(table_spec[1])))
        target = self.mesh if traced_mesh.empty else traced_mesh
        constrain = lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(target, spec))
        rows = jnp.take(constrain(table, table_spec), constrain(ids, ids_spec), axis=0)
        return self(constrain(rows, PartitionSpec(*ids_spec, table_spec[1])), axes)

    def cudnn_refused(self, dtype) -> str:
        """Why cuDNN's fused attention cannot run here on inputs of ``dtype`` ('' where it can): the
        layout (``layout_refuses_fused``), or fp32 inputs (it takes fp16 and bf16)."""
        return self.layout_refuses_fused or cudnn_refusal(dtype)

    def tokamax_refused(self, dtype) -> str:
        """Why tokamax's flash attention cannot run here on inputs of ``dtype`` ('' where it can): the
        layout (``layout_refuses_fused``), a missing tokamax, or inputs other than fp16 and bf16."""
        return self.layout_refuses_fused or tokamax_refusal(dtype)

    def describe_attention(self, spec: AttentionSpec, packed: bool, dtype) -> str:
        """One line: which kernel runs ``spec``'s attention on this mesh for rows packed from
        documents (``packed``) or not, its inputs of ``dtype`` (the compute dtype). ``ConfigError`` on
        ``model.attention`` for a kernel that cannot run here (never a silent fallback)."""
        window = f", sliding window {spec.window}" if spec.window else ""
        if self.ring is not None:
            if spec.kernel not in (AttentionKernel.AUTO, AttentionKernel.BLOCKWISE):
                raise ConfigError("model.attention", f"{spec.kernel.value} cannot run ring attention's steps "
                                  f"(kv_length split over {self.ring}: each step is blockwise); use auto or blockwise")
            stages = self.mesh.shape.get("stage", 1)
            in_stages = (f"; inside the {stages} pipeline stages every sub-block pair is computed, and every stage "
                         "runs every slot of each tick (an idle one's result dropped)" if stages > 1 else "")
            return (f"attention: ring over {self.ring} ({self.mesh.shape[self.ring]} steps, blockwise sub-blocks of "
                    f"at most {self.rules.ring_block or 'all'} positions{window}){in_stages}")
        try:
            kernel = spec.kernel.resolve(self.platform, packed, self.cudnn_refused(dtype), self.tokamax_refused(dtype))
        except ValueError as error:
            raise ConfigError("model.attention", str(error)) from None
        blocks = f", blocks of {spec.block} positions" if kernel is AttentionKernel.BLOCKWISE else ""
        why = (f" (tokamax cannot run {self.tokamax_refused(dtype)})" if spec.kernel is AttentionKernel.AUTO
               and kernel is AttentionKernel.BLOCKWISE and packed and self.platform == "gpu" else "")
        return f"attention: {kernel.value}{blocks}{window}" + (" (document segments)" if packed else "") + why

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
               segments: jax.Array | None, spec: AttentionSpec) -> jax.Array:
        # Inside a pipeline stage (``stage`` manual) a nested shard_map compiles on no supported jax
        # (docs/long_context.md): there XLA partitions the kernel over the queries' split as it can.
        in_stage = not jax.sharding.get_abstract_mesh().empty
        if self.ring is None:
            spec = spec.resolved(self.platform, packed=segments is not None, cudnn_refused=self.cudnn_refused(q.dtype),
                                 tokamax_refused=self.tokamax_refused(q.dtype))
            if self.query_axes and not in_stage and spec.kernel is AttentionKernel.BLOCKWISE:
                return self._attend_local_queries(q, k, v, segments, spec)
            if spec.kernel is AttentionKernel.TOKAMAX:
                return self._attend_tokamax(q, k, v, segments, spec)
            return attend(q, k, v, segments, spec)
        if in_stage:
            return ring_attention_in_stage(q, k, v, positions, segments, axis=self.ring,
                                           ranks=self.mesh.shape[self.ring], block=self.rules.ring_block,
                                           window=spec.window)
        return ring_attention(q, k, v, positions, segments, mesh=self.mesh, axis=self.ring,
                              block=self.rules.ring_block, window=spec.window)

    def _attend_tokamax(self, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None,
                        spec: AttentionSpec) -> jax.Array:
        """tokamax's kernel on each device's rows and heads: a ``shard_map`` manual over the mesh axes
        splitting ``batch`` and, where they split ``kv_heads`` alike and both head counts divide, ``heads``
        (XLA runs a custom call unpartitioned, on gathered inputs). Traced with the mesh's first device
        as JAX's default device, whose GPU generation tokamax builds its kernel for. Mosaic-GPU calls
        take no operands typed as varying over manual axes, so the ``shard_map`` does not check those
        types; every operand varies over every manual axis, so no gradient needs a sum over one."""
        batch = mesh_axes_of(self.rules.activation_spec(("batch",))[0])
        heads = mesh_axes_of(self.rules.activation_spec(("heads",))[0])
        ways = math.prod(self.mesh.shape[a] for a in heads)
        alike = heads == mesh_axes_of(self.rules.activation_spec(("kv_heads",))[0])
        if not alike or q.shape[2] % ways or k.shape[2] % ways:
            heads = ()
        per_head = PartitionSpec(batch or None, None, heads or None, None)
        rows = None if segments is None else PartitionSpec(batch or None, None)
        kernel = lambda q, k, v, segments: attend(q, k, v, segments, spec)
        with jax.default_device(self.mesh.devices.flat[0]):
            return jax.shard_map(kernel, mesh=self.mesh, in_specs=(per_head, per_head, per_head, rows),
                                 out_specs=per_head, axis_names=set(batch + heads), check_vma=False)(q, k, v, segments)

    def _attend_local_queries(self, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None,
                              spec: AttentionSpec) -> jax.Array:
        """Blockwise attention under context parallelism with the keys gathered: each device runs
        the kernel for the queries it holds (a ``shard_map`` manual over the mesh axes splitting
        ``length``) against every key, so no device computes another's queries."""
        axes = self.query_axes
        local = q.shape[1] // math.prod(self.mesh.shape[a] for a in axes)

        def body(q, k, v, q_segments, k_segments):
            # Every device's keys vary with its queries' share of their gradient (summed on the way out).
            k, v = (varying_summed_in_fp32(x, axes) for x in (k, v))
            rank = 0
            for axis in axes:  # the row-major index over the axes splitting the positions
                rank = rank * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
            return blockwise_attention(q, k, v, q_segments, k_segments, window=spec.window, block=spec.block,
                                       query_start=(rank * local).astype(jnp.int32))

        queries, whole = PartitionSpec(None, axes), PartitionSpec()
        segment_specs = (None, None) if segments is None else (queries, whole)
        return jax.shard_map(body, mesh=self.mesh, in_specs=(queries, whole, whole, *segment_specs),
                             out_specs=queries, axis_names=set(axes))(q, k, v, segments, segments)

    def run_experts(self, compute: ExpertCompute, x: jax.Array, choices: jax.Array,
                    params: tuple[jax.Array, ...], param_axes: tuple[LogicalAxes, ...],
                    buffer_factor: float) -> tuple[jax.Array, jax.Array]:
        return experts.run_experts(compute, x, choices, params, param_axes, buffer_factor,
                                   rules=self.rules, mesh=self.mesh)


def activation_sharding(rules: ShardingRules, mesh: Mesh) -> ActivationSharding:
    """The constraints and attention a model applies to its activations on ``mesh``."""
    return MeshActivationSharding(rules, mesh)
