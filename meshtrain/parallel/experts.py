"""Expert parallelism for a sorted (grouped) dispatch: each token choice's row travels to the device
holding its expert and its result travels back, in one ``shard_map`` over the whole mesh.

On every device (its tokens ``[b, s]`` of the batch, its ``E / EP`` experts):

1. the ``b * s * top_k`` choice rows are numbered within their destination peer (the expert's
   rank over the expert-parallel mesh axes, row-major like the experts' split) and scattered
   into a fixed buffer ``[EP, C, embed]``, ``C`` rows per peer;
2. one ``all_to_all`` over the expert axes: each device receives the rows bound for its experts;
3. the model's ``ExpertCompute`` runs its experts over exactly those rows (padding rows carry an
   id past the local experts and cost nothing in the grouped matmuls);
4. the reverse ``all_to_all``, each choice reads its row back, and the rows are summed over the
   mesh axes splitting the experts' hidden dimension (tensor parallelism): ``m`` rows, not the
   ``EP x C`` of the buffers.

``C`` is ``ceil(buffer_factor * b * s * top_k / EP)`` (at most ``b * s * top_k``); ``buffer_factor
= 0`` gives the worst case, ``b * s * top_k``, with which no choice is ever dropped: every device
receives ``EP`` buffers of that many rows. A choice past its peer's ``C`` rows is dropped (zero
output) and counted.

Two exchanges (``Exchange``, chosen from the devices' platform at start-up, said in one line):

* ``buffers`` (XLA:CPU, which does not implement ``ragged-all-to-all``: ``UNIMPLEMENTED``): the
  fixed ``[EP, C, embed]`` buffers above, one ``all_to_all`` each way: ``EP x C`` rows travel
  whatever the tokens.
* ``ragged`` (GPU, TPU): ``jax.lax.ragged_all_to_all`` sends each peer exactly its rows. Each
  device receives into one buffer of ``EP x C`` rows (the same bound, the same memory): the
  sources' rows in source order, each source's cut where the buffer is full (the receiver tells
  each source how many it takes; with ``buffer_factor = 0`` all of them). Two small
  ``all_to_all``s of per-peer counts and offsets come first; the results return by the reverse
  ragged exchange.

FP8 experts (``models.kernels.fp8.Fp8Weight``, ``train.precision: fp8``) carry the mesh's axes as their
``amax_axes``, so that each amax inside the ``shard_map`` is the maximum over every device: the
quantisation is the one-device run's.

Inside a pipeline stage (``stage`` already manual) no nested ``shard_map`` compiles on a supported
jax (docs/long_context.md), so there the same steps are written for XLA's partitioner
(``_run_in_stage``: ``vmap`` over the peers, the all-to-all a resharding transpose).
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.parallel.rules import ShardingRules, mesh_axes_of
from models.common import ExpertCompute, LogicalAxes, choice_rows
from models.kernels.attention import varying_axes
from models.kernels.fp8 import Fp8Weight

TOKEN_AXES: LogicalAxes = ("batch", "length")


def expert_axes(rules: ShardingRules, mesh: Mesh, param_axes: LogicalAxes) -> tuple[str, ...]:
    """The mesh axes (size > 1) splitting the experts (``param_axes[0]``) in compute."""
    return tuple(a for a in mesh_axes_of(rules.activation_spec(param_axes[:1])[0]) if mesh.shape[a] > 1)


class Exchange(enum.Enum):
    """How a sorted dispatch's rows travel to their experts' devices (module docstring)."""

    BUFFERS = "all-to-all of fixed per-peer buffers (this backend has no ragged all-to-all)"
    RAGGED = "ragged all-to-all (each peer gets exactly its rows)"

    @classmethod
    def of(cls, mesh: Mesh) -> Exchange:
        """The exchange on ``mesh``'s devices: ragged where XLA implements it (GPU, TPU)."""
        platform = mesh.devices.flat[0].platform
        return cls.BUFFERS if platform == "cpu" else cls.RAGGED


def describe_exchange(rules: ShardingRules, mesh: Mesh, expert_axis: str, sorted_dispatch: bool) -> str | None:
    """One line: how the rows of the model's dispatch (sorted, or one-hot: ``models.api.RoutedExperts``)
    reach the experts of logical axis ``expert_axis`` on this mesh; None when the experts are not
    split (every device runs its own tokens' choices)."""
    axes = expert_axes(rules, mesh, (expert_axis,))
    if not axes:
        return None
    peers = math.prod(mesh.shape[a] for a in axes)
    if not sorted_dispatch:
        return (f"experts: split {peers} ways over {list(axes)}; a one-hot dispatch's slots travel as XLA "
                "partitions them (all-to-all of a resharding)")
    stages = (f"; inside the {mesh.shape['stage']} pipeline stages as XLA's all-to-all of a resharding"
              if mesh.shape.get("stage", 1) > 1 else "")
    return (f"experts: split {peers} ways over {list(axes)}; a sorted dispatch's rows travel by "
            f"{Exchange.of(mesh).value}{stages}")


def exchange_rows(choices: int, peers: int, buffer_factor: float) -> int:
    """Rows per peer buffer for ``choices`` token choices on a device (module docstring)."""
    if buffer_factor == 0:
        return choices
    return min(choices, math.ceil(buffer_factor * choices / peers))


def run_experts(compute: ExpertCompute, x: jax.Array, choices: jax.Array, params: tuple[jax.Array, ...],
                param_axes: tuple[LogicalAxes, ...], buffer_factor: float, *, rules: ShardingRules,
                mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """``models.common.ActivationSharding.run_experts`` on ``mesh`` under ``rules`` (module docstring).
    ``compute`` is traced with the mesh's first device as JAX's default device: a kernel that reads the
    GPU's generation from it (tokamax's grouped GEMM) compiles for the mesh's devices, also where a CPU
    host compiles for compile-only GPUs."""
    with jax.default_device(mesh.devices.flat[0]):
        return _run_experts(compute, x, choices, params, param_axes, buffer_factor, rules=rules, mesh=mesh)


def _run_experts(compute: ExpertCompute, x: jax.Array, choices: jax.Array, params: tuple[jax.Array, ...],
                 param_axes: tuple[LogicalAxes, ...], buffer_factor: float, *, rules: ShardingRules,
                 mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    top_k, width = choices.shape[-1], x.shape[-1]
    if not jax.sharding.get_abstract_mesh().empty:  # inside a pipeline stage
        return _run_in_stage(compute, x, choices, params, param_axes, buffer_factor, rules)
    specs = [rules.activation_spec(axes) for axes in param_axes]
    hidden = []  # size-1 axes too: the values vary over every axis named
    for axes, spec in zip(param_axes, specs):
        for dim in range(1, len(axes)):
            if axes[dim] != param_axes[-1][1] and any(mesh.shape[a] > 1 for a in mesh_axes_of(spec[dim])):
                raise ConfigError(f"sharding.rules.{axes[dim]}", "the experts' input width cannot be split under "
                                  "the sorted dispatch (split their hidden dimension, or the experts)")
            hidden += [a for a in mesh_axes_of(spec[dim]) if a not in hidden]
    experts = mesh_axes_of(specs[0][0])  # size-1 axes too: the values vary over every axis named
    token_spec = rules.activation_spec(TOKEN_AXES)
    token_axes = tuple(a for entry in token_spec for a in mesh_axes_of(entry))
    if not set(expert_axes(rules, mesh, param_axes[0])) <= {a for a in token_axes if mesh.shape[a] > 1}:
        raise ConfigError(f"sharding.rules.{param_axes[0][0]}", f"the experts split over {experts} must be "
                          f"computed where the tokens are split (over {list(token_axes)})")
    peers = math.prod(mesh.shape[a] for a in experts)
    exchange = _ragged_exchange if Exchange.of(mesh) is Exchange.RAGGED else _exchange
    # FP8 weights (models.kernels.fp8): amaxes are maxima over the mesh, their amaxes and histories whole.
    params = tuple(p.replace(amax_axes=tuple(mesh.axis_names)) if isinstance(p, Fp8Weight) else p for p in params)
    specs = [p.replace(weight=spec, observed=PartitionSpec(), history=None if p.history is None else PartitionSpec())
             if isinstance(p, Fp8Weight) else spec for p, spec in zip(params, specs)]

    def body(x: jax.Array, choices: jax.Array, *params: jax.Array) -> tuple[jax.Array, jax.Array]:
        rows, ids = choice_rows(x, top_k), choices.reshape(-1)
        # The rows marked as differing over the hidden split: the backward then sums their
        # gradient over it once, here over these m rows (this cast's transpose), not inside
        # each grouped matmul over its padded buffer.
        missing = tuple(a for a in hidden if a not in varying_axes(rows))
        rows = jax.lax.pcast(rows, missing, to="varying") if missing else rows
        dropped = jnp.zeros((), jnp.int32)
        if peers == 1:
            out = compute(rows, ids, *params)
            if hidden:
                out = jax.lax.psum(out, tuple(hidden))
        else:
            out, dropped = exchange(compute, rows, ids, params, experts, peers, buffer_factor, tuple(hidden))
        if token_axes:
            dropped = jax.lax.psum(dropped, token_axes)
        return out.reshape(*choices.shape, width), dropped

    tokens = PartitionSpec(*token_spec, None)
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, *specs),
                         out_specs=(PartitionSpec(*token_spec, None, None), PartitionSpec()))(x, choices, *params)


def _weight(param: jax.Array | Fp8Weight) -> jax.Array:
    return param.weight if isinstance(param, Fp8Weight) else param


def _pack(rows: jax.Array, ids: jax.Array, local: int, peers: int, capacity: int
          ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One device's rows [m, embed] for experts ``ids`` [m] -> (the send buffer [peers, capacity,
    embed], the rows' expert ids on their peer [peers, capacity] (``local`` in padding rows: no
    expert), each row's slot in the flattened buffer [m] and whether it fits [m]); step 1."""
    m, width = rows.shape
    peer, local_ids = ids // local, ids % local
    order = jnp.argsort(peer, stable=True)
    counts = jnp.bincount(peer, length=peers)
    starts = jnp.cumsum(counts) - counts
    position = jnp.zeros(m, jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32) - starts[peer[order]],
                                                     unique_indices=True)
    kept = position < capacity
    # A dropped row's slot is past the buffer and its own: the scatters are unique (their transpose a gather).
    slot = jnp.where(kept, peer * capacity + position, peers * capacity + jnp.arange(m, dtype=jnp.int32))
    unique = dict(mode="drop", unique_indices=True)
    send = jnp.zeros((peers * capacity, width), rows.dtype).at[slot].set(rows, **unique)
    send_ids = jnp.full((peers * capacity,), local, ids.dtype).at[slot].set(local_ids, **unique)
    return send.reshape(peers, capacity, width), send_ids.reshape(peers, capacity), slot, kept


def _unpack(back: jax.Array, slot: jax.Array, kept: jax.Array) -> jax.Array:
    """The returned buffer [peers, capacity, embed] -> each row's result [m, embed], zero where dropped."""
    flat = back.reshape(-1, back.shape[-1])
    return jnp.where(kept[:, None], jnp.take(flat, jnp.minimum(slot, flat.shape[0] - 1), axis=0), 0)


def _exchange(compute: ExpertCompute, rows: jax.Array, ids: jax.Array, params: tuple[jax.Array, ...],
              axes: tuple[str, ...], peers: int, buffer_factor: float, hidden: tuple[str, ...]
              ) -> tuple[jax.Array, jax.Array]:
    """One device's rows [m, embed] for experts ``ids`` [m] -> (their outputs [m, embed], zero where
    dropped; the number dropped), through the peers' experts (steps 1-4 of the module docstring)."""
    capacity = exchange_rows(rows.shape[0], peers, buffer_factor)
    send, send_ids, slot, kept = _pack(rows, ids, _weight(params[0]).shape[0], peers, capacity)
    exchange = lambda a: jax.lax.all_to_all(a, axes, 0, 0)
    out = compute(exchange(send).reshape(-1, rows.shape[1]), exchange(send_ids).reshape(-1), *params)
    # The partial sums over the experts' split hidden dimension are added after the rows are home:
    # over this device's m rows, not the peers x capacity rows of the buffer (mostly padding).
    out = _unpack(exchange(out.reshape(send.shape)), slot, kept)
    return (jax.lax.psum(out, hidden) if hidden else out), jnp.sum(~kept).astype(jnp.int32)


def _ragged_exchange(compute: ExpertCompute, rows: jax.Array, ids: jax.Array, params: tuple[jax.Array, ...],
                     axes: tuple[str, ...], peers: int, buffer_factor: float, hidden: tuple[str, ...]
                     ) -> tuple[jax.Array, jax.Array]:
    """``_exchange`` by ``jax.lax.ragged_all_to_all`` (module docstring): each peer is sent exactly its
    rows, into a receive buffer of ``peers x C`` rows."""
    m, width = rows.shape
    local = _weight(params[0]).shape[0]
    receive = peers * exchange_rows(m, peers, buffer_factor)
    peer, local_ids = ids // local, ids % local
    order = jnp.argsort(peer, stable=True)
    swap = lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)  # [peers] values, one to each peer
    wanted = jnp.bincount(peer, length=peers).astype(jnp.int32)  # my rows for each peer
    first = jnp.cumsum(wanted) - wanted  # where they start in my sorted rows
    offered = swap(wanted)  # each source's rows for me
    start = jnp.cumsum(offered) - offered  # where they start in my receive buffer
    taken = jnp.clip(receive - start, 0, offered)  # what fits
    sent = swap(taken)  # what each peer takes of mine
    ragged = lambda operand, output, *layout: jax.lax.ragged_all_to_all(operand, output, *layout, axis_name=axes)
    there = (first, sent, swap(start), taken)  # my rows -> the peers' buffers
    recv = ragged(rows[order], jnp.zeros((receive, width), rows.dtype), *there)
    recv_ids = ragged(local_ids[order], jnp.full((receive,), local, ids.dtype), *there)
    out = compute(recv, recv_ids, *params)
    back = ragged(out, jnp.zeros((m, width), out.dtype), start, taken, swap(first), sent)  # and home
    out = jnp.zeros_like(back).at[order].set(back, unique_indices=True)  # rows not taken: zero
    dropped = (m - jnp.sum(sent)).astype(jnp.int32)
    return (jax.lax.psum(out, hidden) if hidden else out), dropped


def _run_in_stage(compute: ExpertCompute, x: jax.Array, choices: jax.Array, params: tuple[jax.Array, ...],
                  param_axes: tuple[LogicalAxes, ...], buffer_factor: float, rules: ShardingRules
                  ) -> tuple[jax.Array, jax.Array]:
    """The exchange inside a pipeline stage, where no nested ``shard_map`` compiles: the same steps
    written for XLA's partitioner. The rows are laid out [source peer, ...] along the batch's split,
    each source's buffers built by ``vmap``, then transposed to [destination peer, ...] under a
    sharding constraint (XLA's all-to-all), each destination's experts run by ``vmap`` over the
    experts' split, and back. Needs the experts split over exactly the batch's mesh axes (every
    preset's rule); otherwise the experts run on all rows and XLA partitions them as it can."""
    mesh = jax.sharding.get_abstract_mesh()
    top_k, width = choices.shape[-1], x.shape[-1]
    experts = tuple(a for a in mesh_axes_of(rules.activation_spec(param_axes[0][:1])[0]) if mesh.shape[a] > 1)
    batch = tuple(a for a in mesh_axes_of(rules.activation_spec(("batch",))[0]) if mesh.shape[a] > 1)
    peers = math.prod(mesh.shape[a] for a in experts)
    # FP8 weights: per-peer amaxes under the vmap would not be the tensor's; XLA partitions instead.
    if peers == 1 or experts != batch or x.shape[0] % peers or any(isinstance(p, Fp8Weight) for p in params):
        out = compute(choice_rows(x, top_k), choices.reshape(-1), *params)
        return out.reshape(*choices.shape, width), jnp.zeros((), jnp.int32)
    split = lambda a, *rest: jax.lax.with_sharding_constraint(
        a, NamedSharding(mesh, PartitionSpec(experts, *rest, *(None,) * (a.ndim - 1 - len(rest)))))
    rows = split(choice_rows(x, top_k).reshape(peers, -1, width))  # [source, m, embed]
    ids = split(choices.reshape(peers, -1))
    local = params[0].shape[0] // peers
    capacity = exchange_rows(rows.shape[1], peers, buffer_factor)
    send, send_ids, slot, kept = jax.vmap(lambda r, i: _pack(r, i, local, peers, capacity))(rows, ids)
    # [source, destination, ...] -> [destination, source, ...]: the all-to-all.
    recv, recv_ids = split(jnp.swapaxes(split(send), 0, 1)), split(jnp.swapaxes(split(send_ids), 0, 1))
    by_peer = [split(w.reshape(peers, local, *w.shape[1:])) for w in params]  # each peer's experts
    out = jax.vmap(lambda r, i, *w: compute(r.reshape(-1, width), i.reshape(-1), *w).reshape(r.shape))(
        recv, recv_ids, *by_peer)
    back = split(jnp.swapaxes(split(out), 0, 1))
    result = jax.vmap(_unpack)(back, slot, kept)
    return result.reshape(*choices.shape, width), jnp.sum(~kept).astype(jnp.int32)
