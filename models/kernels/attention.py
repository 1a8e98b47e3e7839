"""Causal self-attention kernels: the dense reference, cuDNN's fused kernel, and blockwise attention.

A query attends a key when the key is not later, lies in the same document (``segments``, when rows
are packed) and, with a sliding window of W, is one of the query's last W positions (itself
included, as Mistral's ``sliding_window``). ``AttentionSpec`` says which kernel computes it:

* ``XLA``: ``jax.nn.dot_product_attention`` with a full ``[queries, keys]`` mask and score block
  (quadratic memory): the dense reference.
* ``CUDNN``: cuDNN's fused flash kernel (NVIDIA GPUs), causal or causal + window; it takes no
  document segments through public JAX, so packed rows cannot use it.
* ``BLOCKWISE``: flash attention in XLA. Queries and keys in blocks of ``block`` positions, an online
  softmax per query block (running max, normaliser and output in fp32), block pairs that no query
  can see skipped: above the diagonal and outside the window statically (those pairs are not in the
  loop at all, so the work is about half the dense product for causal rows, and proportional to the
  window with one), and pairs whose documents cannot meet at run time (``lax.cond``). Grouped-query
  heads attend their shared key/value head without repeating it. The backward (a ``custom_vjp``)
  keeps only the output and the log-sum-exp of each query and recomputes each pair's scores, so
  memory grows linearly with the sequence in both directions.
* ``TOKAMAX``: tokamax's Pallas Mosaic-GPU flash attention (NVIDIA sm90 / sm100 kernels; docs/kernels.md
  for the comparison that chose it), causal, with documents and the window as each query's first
  visible key (``k_start``): a document is a run of equal segment ids, as the packer makes them
  (``models.kernels.tokamax_attention``). bf16 / fp16 inputs; needs tokamax (jax >= 0.11: the gpu-compile extra).
* ``AUTO``: on GPUs, ``CUDNN`` for unpacked rows and ``TOKAMAX`` for packed ones, each where it takes
  the inputs' dtype and sharding (the framework says where it does not: queries split along the
  sequence, pipeline stages) and, for tokamax, where it is installed; else ``BLOCKWISE``
  (``AttentionKernel.resolve``).

The pair updates (``attend_pairs``, ``attend_pairs_backward``) are also the per-step body of ring
attention (``meshtrain.parallel.ring_attention``), which runs them over a key block held by another
device: one implementation of the maths.

Shapes: q [batch, length, heads, head_dim]; k, v [batch, length, kv_heads, head_dim] (heads a
multiple of kv_heads); inside the kernel queries are grouped [batch, kv_heads, groups, ...]. Values
may be narrower than queries and keys (multi-head latent attention's ``v_head_dim``): the blockwise,
ring and tokamax kernels take them as they are; the dense and cuDNN kernels (``jax.nn.dot_product_attention``
takes one width) zero-pad them to the query width and drop the padding from the output.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.kernels.tokamax_attention import tokamax_attention

# Added to masked scores and the initial running max: finite, so that exp(MASKED - m) is 0, not NaN.
MASKED = -1e30
# The order of padded keys: later than any query (and far from int32's limit: orders are subtracted).
PAST_EVERY_QUERY = 1 << 30


class AttentionKernel(str, enum.Enum):
    """``model.attention``: which kernel computes training attention (module docstring).

    AUTO: on GPUs cuDNN for unpacked rows, tokamax for packed ones, where each can run; else blockwise.
    BLOCKWISE: flash attention in XLA, any backend, any mask. CUDNN: cuDNN's fused kernel. TOKAMAX:
    tokamax's Mosaic-GPU flash attention (CUDNN and TOKAMAX: an error where they cannot run). XLA:
    the dense einsum-softmax-einsum (quadratic memory; the reference).
    """

    AUTO = "auto"
    BLOCKWISE = "blockwise"
    CUDNN = "cudnn"
    TOKAMAX = "tokamax"
    XLA = "xla"

    def resolve(self, platform: str, packed: bool, cudnn_refused: str = "", tokamax_refused: str = ""
                ) -> AttentionKernel:
        """The kernel that runs on ``platform`` ("cpu", "gpu", "tpu") for rows packed from
        documents (``packed``) or not, where ``cudnn_refused`` and ``tokamax_refused`` say why
        cuDNN's or tokamax's kernel cannot take the inputs here (their sharding, their dtype, a
        missing tokamax; '' where it can). ``ValueError`` (one line) for a fused kernel where it
        cannot run."""
        if self is AttentionKernel.AUTO:
            if platform == "gpu" and not packed and not cudnn_refused:
                return AttentionKernel.CUDNN
            return AttentionKernel.TOKAMAX if platform == "gpu" and packed and not tokamax_refused \
                else AttentionKernel.BLOCKWISE
        if self in (AttentionKernel.CUDNN, AttentionKernel.TOKAMAX) and platform != "gpu":
            raise ValueError(f"{self.value} needs an NVIDIA GPU, these devices are {platform}; valid here: auto, "
                             "blockwise, xla")
        if self is AttentionKernel.CUDNN and packed:
            raise ValueError("cudnn takes no document segments (data.packing: documents); use auto or blockwise")
        if self is AttentionKernel.CUDNN and cudnn_refused:
            raise ValueError(f"cudnn cannot run {cudnn_refused}; use auto or blockwise")
        if self is AttentionKernel.TOKAMAX and tokamax_refused:
            raise ValueError(f"tokamax cannot run {tokamax_refused}; use auto or blockwise")
        return self


def cudnn_refusal(dtype) -> str:
    """Why cuDNN's fused attention refuses inputs of ``dtype`` ('' where it takes them: fp16, bf16;
    jax raises "Q must be fp16/bf16/fp8_e4m3fn/fp8_e5m2" at trace time otherwise)."""
    return "on fp32 inputs (it takes fp16 and bf16)" if np.dtype(dtype) == np.float32 else ""


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What a model asks of its attention: the kernel, the sliding window (positions a query sees,
    itself included; 0 = the whole causal prefix) and the blockwise kernel's block (positions per
    query and key block; a length it does not divide is padded)."""

    kernel: AttentionKernel = AttentionKernel.AUTO
    window: int = 0
    block: int = 512

    def resolved(self, platform: str, packed: bool, cudnn_refused: str = "", tokamax_refused: str = ""
                 ) -> AttentionSpec:
        """This spec with the kernel that runs on ``platform`` (``AttentionKernel.resolve``)."""
        return dataclasses.replace(self, kernel=self.kernel.resolve(platform, packed, cudnn_refused, tokamax_refused))


# ----- the visibility of keys to queries -----

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QueryBlocks:
    """Queries split into blocks: ``q`` [blocks, batch, kv_heads, groups, block, head_dim] (fp32 or
    the compute dtype, pre-scaled by head_dim ** -0.5), ``order`` int [blocks, batch, block] (what
    causality and the window compare: the index in the row, or the position under ring attention),
    ``segments`` int [blocks, batch, block] or None."""

    q: jax.Array
    order: jax.Array
    segments: jax.Array | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KeyBlocks:
    """Keys and values split into blocks: ``k``, ``v`` [blocks, batch, block, kv_heads, head_dim],
    ``order`` and ``segments`` as ``QueryBlocks``'."""

    k: jax.Array
    v: jax.Array
    order: jax.Array
    segments: jax.Array | None


def _visible(q_order: jax.Array, k_order: jax.Array, q_segments: jax.Array | None,
             k_segments: jax.Array | None, window: int) -> jax.Array:
    """bool [batch, 1, 1, queries, keys] for one block pair (orders, segments [batch, positions])."""
    visible = k_order[:, None, :] <= q_order[:, :, None]
    if window:
        visible &= q_order[:, :, None] - k_order[:, None, :] < window
    if q_segments is not None:
        visible &= q_segments[:, :, None] == k_segments[:, None, :]
    return visible[:, None, None]


def _pick(tree, index: jax.Array):
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, 0, keepdims=False), tree)


def _put(tree, index: jax.Array, values):
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, index, 0), tree, values)


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """fp32 [batch, kv_heads, groups, queries, keys] of q [batch, kv_heads, groups, queries, d] and
    k [batch, keys, kv_heads, d] (summed in fp32 whatever their dtype)."""
    return jnp.einsum("bkgtd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)


# ----- the forward: online softmax over block pairs -----

# (out [blocks, batch, kv_heads, groups, block, head_dim], running max and normaliser [blocks, batch,
# kv_heads, groups, block]), all fp32: a query block's softmax so far.
SoftmaxState = tuple[jax.Array, jax.Array, jax.Array]
# (dq [q blocks, ...] like QueryBlocks.q, dk, dv [k blocks, ...] like KeyBlocks.k), all fp32.
Gradients = tuple[jax.Array, jax.Array, jax.Array]


def varying_axes(value: jax.Array | jax.core.ShapedArray) -> set[str]:
    """The manual mesh axes ``value`` (or a traced value's type) varies over (inside a ``shard_map``;
    empty outside)."""
    aval = value if isinstance(value, jax.core.ShapedArray) else jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    return set(manual.varying) if manual is not None else set(getattr(aval, "vma", ()))


def varying_like(value: jax.Array, reference: jax.Array) -> jax.Array:
    """``value`` made varying over the manual mesh axes ``reference`` varies over (inside a
    ``shard_map``), so that a loop carry starting as ``value`` keeps one type; else unchanged."""
    axes = tuple(varying_axes(reference))
    return jax.lax.pcast(value, axes, to="varying") if axes else value


def initial_state(queries: QueryBlocks, head_dim: int) -> SoftmaxState:
    shape = queries.q.shape[:-1]
    state = (jnp.zeros((*shape, head_dim), jnp.float32), jnp.full(shape, MASKED, jnp.float32),
             jnp.zeros(shape, jnp.float32))
    return tuple(varying_like(x, queries.q) for x in state)


def zero_gradients(queries: QueryBlocks, keys: KeyBlocks) -> Gradients:
    """fp32 zeros for (dq, dk, dv) blocked like ``queries`` and ``keys``."""
    return tuple(varying_like(jnp.zeros(x.shape, jnp.float32), x) for x in (queries.q, keys.k, keys.v))


def _update(state, query_block, key_block, window: int):
    """One online-softmax update of a query block's state by a key block."""
    out, running_max, normaliser = state
    visible = _visible(query_block.order, key_block.order, query_block.segments, key_block.segments, window)
    scores = jnp.where(visible, _scores(query_block.q, key_block.k), MASKED)
    new_max = jnp.maximum(running_max, scores.max(-1))
    weights = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
    correction = jnp.exp(running_max - new_max)
    normaliser = normaliser * correction + weights.sum(-1)
    values = jnp.einsum("bkgts,bskd->bkgtd", weights.astype(key_block.v.dtype), key_block.v,
                        preferred_element_type=jnp.float32)
    return out * correction[..., None] + values, new_max, normaliser


def _tied(queries: QueryBlocks, keys: KeyBlocks) -> tuple[QueryBlocks, KeyBlocks]:
    """The blocks through one ``optimization_barrier``, so that the orders and segments count as
    data computed with the queries and keys. Without it, differentiating an enclosing ``scan`` (the
    layers) hoists the visibility masks, which depend on constants only, out of both loops and
    keeps every pair's mask at once: [pairs, batch, heads, block, block], quadratic memory."""
    return jax.lax.optimization_barrier((queries, keys))


def _any_visible(query_block, key_block, window: int) -> jax.Array:
    return jnp.any(_visible(query_block.order, key_block.order, query_block.segments, key_block.segments, window))


def attend_pairs(state: SoftmaxState, queries: QueryBlocks, keys: KeyBlocks, pairs: np.ndarray, *,
                 window: int, skip_hidden: bool) -> SoftmaxState:
    """``state`` updated by every (query block, key block) pair of ``pairs`` (int [pairs, 2]), in
    order, in one ``lax.scan``; with ``skip_hidden`` a pair no query of which sees any key is skipped
    at run time (``lax.cond``)."""
    queries, keys = _tied(queries, keys)

    def visit(state, pair):
        query_block, key_block = _pick(queries, pair[0]), _pick(keys, pair[1])
        update = lambda s: _update(s, query_block, key_block, window)
        old = _pick(state, pair[0])
        new = jax.lax.cond(_any_visible(query_block, key_block, window), update, lambda s: s, old) \
            if skip_hidden else update(old)
        return _put(state, pair[0], new), None

    return _visit_pairs(visit, state, pairs)


def finish(state: SoftmaxState) -> tuple[jax.Array, jax.Array]:
    """(output [blocks, batch, kv_heads, groups, block, head_dim], log-sum-exp [blocks, batch,
    kv_heads, groups, block]) in fp32; a query that sees no key (padding) gets 0 and MASKED."""
    out, running_max, normaliser = state
    seen = normaliser > 0
    out = jnp.where(seen[..., None], out / jnp.where(seen, normaliser, 1.0)[..., None], 0.0)
    return out, jnp.where(seen, running_max + jnp.log(jnp.where(seen, normaliser, 1.0)), MASKED)


# ----- the backward: recomputed scores per block pair -----

def attend_pairs_backward(grads: Gradients, queries: QueryBlocks, keys: KeyBlocks, d_out: jax.Array,
                          delta: jax.Array, lse: jax.Array, pairs: np.ndarray, *, window: int,
                          skip_hidden: bool) -> Gradients:
    """``grads`` plus every pair's share of the gradients of the pre-scaled queries, the keys and
    the values, given the output's cotangent ``d_out`` and ``delta`` (``output_cotangent``) and the
    forward's log-sum-exp ([q blocks, batch, kv_heads, groups, block])."""
    queries, keys = _tied(queries, keys)

    def update(grads, query_block, key_block, d_out, lse, delta):
        dq, dk, dv = grads
        visible = _visible(query_block.order, key_block.order, query_block.segments, key_block.segments, window)
        weights = jnp.where(visible, jnp.exp(_scores(query_block.q, key_block.k) - lse[..., None]), 0.0)
        dv = dv + jnp.einsum("bkgts,bkgtd->bskd", weights, d_out)
        d_weights = jnp.einsum("bkgtd,bskd->bkgts", d_out, key_block.v, preferred_element_type=jnp.float32)
        d_scores = weights * (d_weights - delta[..., None])
        dq = dq + jnp.einsum("bkgts,bskd->bkgtd", d_scores, key_block.k, preferred_element_type=jnp.float32)
        dk = dk + jnp.einsum("bkgts,bkgtd->bskd", d_scores, query_block.q, preferred_element_type=jnp.float32)
        return dq, dk, dv

    def visit(grads, pair):
        i, j = pair[0], pair[1]
        query_block, key_block = _pick(queries, i), _pick(keys, j)
        dq, dk, dv = grads
        pair_grads = (_pick(dq, i), _pick(dk, j), _pick(dv, j))
        per_query = (_pick(d_out, i), _pick(lse, i), _pick(delta, i))
        run = lambda g: update(g, query_block, key_block, *per_query)
        pair_grads = jax.lax.cond(_any_visible(query_block, key_block, window), run, lambda g: g, pair_grads) \
            if skip_hidden else run(pair_grads)
        return (_put(dq, i, pair_grads[0]), _put(dk, j, pair_grads[1]), _put(dv, j, pair_grads[2])), None

    return _visit_pairs(visit, grads, pairs)


def _visit_pairs(visit: Callable, carry, pairs: np.ndarray):
    """``visit`` over ``pairs`` in one ``lax.scan``; a single pair (a row within one block) without
    the loop, which XLA then compiles as straight-line code."""
    if len(pairs) == 1:
        return visit(carry, jnp.asarray(pairs[0], jnp.int32))[0]
    return jax.lax.scan(visit, carry, jnp.asarray(pairs, jnp.int32))[0]


# ----- blocking -----

def split_queries(q: jax.Array, order: jax.Array, segments: jax.Array | None, block: int,
                  kv_heads: int) -> QueryBlocks:
    """q [batch, length, heads, head_dim] (length a multiple of ``block``), order and segments
    [batch, length] -> ``QueryBlocks`` (queries pre-scaled by head_dim ** -0.5, heads grouped by
    their key/value head)."""
    return QueryBlocks(group_heads(q * q.shape[-1] ** -0.5, block, kv_heads), _blocks(order, block),
                       _blocks(segments, block))


def split_keys(k: jax.Array, v: jax.Array, order: jax.Array, segments: jax.Array | None, block: int) -> KeyBlocks:
    """k, v [batch, length, kv_heads, head_dim], order and segments [batch, length] -> ``KeyBlocks``."""
    return KeyBlocks(_blocks(k, block), _blocks(v, block), _blocks(order, block), _blocks(segments, block))


def _blocks(x: jax.Array | None, block: int) -> jax.Array | None:
    """[batch, length, ...] -> [length / block, batch, block, ...]."""
    if x is None:
        return None
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:]), 1, 0)


def group_heads(x: jax.Array, block: int, kv_heads: int) -> jax.Array:
    """[batch, length, heads, d] -> [length / block, batch, kv_heads, heads / kv_heads, block, d]."""
    batch, length, heads, head_dim = x.shape
    grouped = x.reshape(batch, length // block, block, kv_heads, heads // kv_heads, head_dim)
    return grouped.transpose(1, 0, 3, 4, 2, 5)


def ungroup_heads(x: jax.Array) -> jax.Array:
    """[blocks, batch, kv_heads, groups, block, d] -> [batch, blocks * block, kv_heads * groups, d]."""
    n, batch, kv_heads, groups, block, head_dim = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(batch, n * block, kv_heads * groups, head_dim)


def unblock(x: jax.Array) -> jax.Array:
    """[length / block, batch, block, ...] -> [batch, length, ...]."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def causal_pairs(blocks: int, block: int, window: int) -> np.ndarray:
    """int [pairs, 2]: the (query block, key block) pairs of a row in sequence order in which some
    query can see some key: key block <= query block, and with a window, the key block's last
    position within ``window - 1`` of the query block's first."""
    pairs = [(i, j) for i in range(blocks) for j in range(i + 1)
             if not window or (j + 1) * block - 1 > i * block - window]
    return np.asarray(pairs, np.int32).reshape(-1, 2)


def all_pairs(query_blocks: int, key_blocks: int) -> np.ndarray:
    """int [pairs, 2]: every (query block, key block) pair, query-major."""
    return np.stack(np.meshgrid(np.arange(query_blocks), np.arange(key_blocks), indexing="ij"),
                    -1).reshape(-1, 2).astype(np.int32)


def output_cotangent(d_out: jax.Array, out: jax.Array, block: int, kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """The output's cotangent d_out [batch, length, heads, head_dim] blocked like ``finish``'s
    output ``out``, and delta = sum(d_out * out) over head_dim: what ``attend_pairs_backward`` takes."""
    d_out = group_heads(d_out.astype(jnp.float32), block, kv_heads)
    return d_out, jnp.sum(d_out * out, axis=-1)


def input_gradients(grads: Gradients, q: jax.Array, k: jax.Array, v: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Blocked fp32 gradients of the pre-scaled queries, keys, values -> (dq, dk, dv) shaped and
    typed like q, k, v."""
    dq, dk, dv = grads
    dq = ungroup_heads(dq) * q.shape[-1] ** -0.5
    return dq.astype(q.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype)


# ----- the blockwise kernel -----

def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segments: jax.Array | None = None,
                        k_segments: jax.Array | None = None, *, window: int = 0, block: int = 512,
                        query_start: jax.Array | None = None) -> jax.Array:
    """Causal attention (module docstring) of q [batch, queries, heads, head_dim] to k, v [batch,
    keys, kv_heads, head_dim] -> [batch, queries, heads, head_dim] in q's dtype.

    ``query_start`` None: queries and keys are the same positions of a row (self-attention); the
    block pairs above the diagonal or outside the window are left out of the loop. Else (int, may be
    traced) the row index of the first query, keys being the whole row from index 0 (a device's
    queries under context parallelism): every pair is visited, hidden ones skipped at run time.
    Segments int [batch, queries] / [batch, keys] (both or neither). A length ``block`` does not
    divide is padded with positions no real query sees.
    """
    queries, keys = q.shape[1], k.shape[1]
    q_block, k_block = min(block, queries), min(block, keys)
    q_order = jnp.arange(queries, dtype=jnp.int32) + (0 if query_start is None else query_start)
    k_order = jnp.arange(keys, dtype=jnp.int32)
    # No query sees a padded key, and a padded query sees nothing: their segments differ from every
    # real one and padded keys come after every query, padded queries before every key.
    q, q_order, q_segments = _pad(q_block, q, q_order, q_segments, -1, -1)
    k, k_order, k_segments = _pad(k_block, k, k_order, k_segments, -2, PAST_EVERY_QUERY)
    v = _pad(k_block, v, None, None, 0, 0)[0]
    batch = q.shape[0]
    q_order, k_order = (jnp.broadcast_to(order[None], (batch, order.shape[0])) for order in (q_order, k_order))
    out = _blockwise(q, k, v, q_order, k_order, q_segments, k_segments, window, (q_block, k_block),
                     query_start is None)
    return out[:, :queries]


def _pad(block: int, x: jax.Array, order: jax.Array | None, segments: jax.Array | None, segment_fill: int,
         order_fill: int):
    """x [batch, length, ...], order [length], segments [batch, length] padded to a multiple of
    ``block`` with ``order_fill`` and ``segment_fill``."""
    extra = -x.shape[1] % block
    if not extra:
        return x, order, segments
    x = jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
    if order is not None:
        order = jnp.concatenate([order, jnp.full((extra,), order_fill, jnp.int32)])
    if segments is not None:
        segments = jnp.pad(segments, [(0, 0), (0, extra)], constant_values=segment_fill)
    return x, order, segments


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _blockwise(q, k, v, q_order, k_order, q_segments, k_segments, window: int, blocks: tuple[int, int],
               in_order: bool):
    return _blockwise_forward(q, k, v, q_order, k_order, q_segments, k_segments, window, blocks, in_order)[0]


def _pairs_of(queries: QueryBlocks, keys: KeyBlocks, block: int, window: int, in_order: bool) -> np.ndarray:
    """In order (queries and keys the same positions, one block size): the causal pairs; else all."""
    if in_order:
        return causal_pairs(queries.q.shape[0], block, window)
    return all_pairs(queries.q.shape[0], keys.k.shape[0])


def _blockwise_forward(q, k, v, q_order, k_order, q_segments, k_segments, window, blocks, in_order):
    (q_block, k_block) = blocks
    queries = split_queries(q, q_order, q_segments, q_block, k.shape[2])
    keys = split_keys(k, v, k_order, k_segments, k_block)
    state = attend_pairs(initial_state(queries, v.shape[-1]), queries, keys,
                         _pairs_of(queries, keys, q_block, window, in_order), window=window,
                         skip_hidden=q_segments is not None or not in_order)
    out, lse = finish(state)
    return ungroup_heads(out).astype(q.dtype), (q, k, v, q_order, k_order, q_segments, k_segments, out, lse)


def _blockwise_backward(window, blocks, in_order, residuals, d_out):
    q, k, v, q_order, k_order, q_segments, k_segments, out, lse = residuals
    (q_block, k_block) = blocks
    queries = split_queries(q, q_order, q_segments, q_block, k.shape[2])
    keys = split_keys(k, v, k_order, k_segments, k_block)
    grads = attend_pairs_backward(zero_gradients(queries, keys), queries, keys,
                                  *output_cotangent(d_out, out, q_block, k.shape[2]), lse,
                                  _pairs_of(queries, keys, q_block, window, in_order), window=window,
                                  skip_hidden=q_segments is not None or not in_order)
    return input_gradients(grads, q, k, v) + (None, None, None, None)


_blockwise.defvjp(_blockwise_forward, _blockwise_backward)


# ----- the dense kernels and the dispatch -----

def attention_mask(query_order: jax.Array, key_order: jax.Array, segments: jax.Array | None = None,
                   window: int = 0) -> jax.Array:
    """bool [batch or 1, 1, queries, keys]: whether each query sees each key (module docstring), for
    queries and keys at row indices ``query_order`` and ``key_order`` (int [queries], [keys]);
    ``segments`` (int [batch, length]) only where both are the whole row."""
    return _visible(query_order[None], key_order[None], segments, segments, window)[:, :, 0]


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None,
                    window: int) -> jax.Array:
    """The reference: XLA's ``dot_product_attention`` with the full mask."""
    index = jnp.arange(q.shape[1])
    return jax.nn.dot_product_attention(q, k, v, mask=attention_mask(index, index, segments, window),
                                        implementation="xla")


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int) -> jax.Array:
    """cuDNN's fused kernel: causal, with the window as its ``local_window_size`` (left W - 1)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn",
                                        local_window_size=(window - 1, 0) if window else None)


def _one_width(kernel: Callable) -> Callable:
    """``kernel`` (of q, k, v, ...) for values narrower than the queries: v zero-padded to q's width,
    the output's padding dropped."""
    def padded(q, k, v, *args):
        width = v.shape[-1]
        if width == q.shape[-1]:
            return kernel(q, k, v, *args)
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, q.shape[-1] - width)])
        return kernel(q, k, v, *args)[..., :width]
    return padded


def attend(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, spec: AttentionSpec) -> jax.Array:
    """Causal self-attention of rows in sequence order by ``spec``'s kernel, already resolved for
    the devices that run it (``AttentionSpec.resolved``; the caller knows them, this function does
    not): q [batch, length, heads, head_dim], k [batch, length, kv_heads, head_dim], v [batch,
    length, kv_heads, value_dim] (value_dim <= head_dim), segments int [batch, length] or None ->
    [batch, length, heads, value_dim]."""
    if spec.kernel is AttentionKernel.AUTO:
        raise ValueError("attend needs a resolved kernel: AttentionSpec.resolved(platform, packed) first")
    return _KERNELS[spec.kernel](q, k, v, segments, spec)


_KERNELS: dict[AttentionKernel, Callable] = {
    AttentionKernel.XLA: _one_width(lambda q, k, v, segments, spec: dense_attention(q, k, v, segments, spec.window)),
    AttentionKernel.CUDNN: _one_width(lambda q, k, v, segments, spec: cudnn_attention(q, k, v, spec.window)),
    AttentionKernel.TOKAMAX: lambda q, k, v, segments, spec: tokamax_attention(q, k, v, segments, spec.window),
    AttentionKernel.BLOCKWISE: lambda q, k, v, segments, spec: blockwise_attention(
        q, k, v, segments, segments, window=spec.window, block=spec.block),
}
