"""Sampling from a model with its KV cache: the tokenizers of the tools (UTF-8 bytes or a
``tokenizer.json``) and ``generate_tokens``, which ``meshtrain.generate`` (the command line) and the
evaluation's samples during training (``eval.sample_prompts``) share.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain.data.tokenizer import end_of_document_id, load_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.mesh import device_memory_bytes
from meshtrain.metrics import format_bytes
from models.common import ActivationSharding, unconstrained


class Tokenizer(Protocol):
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclasses.dataclass
class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (ids above 255 decode to nothing)."""

    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@dataclasses.dataclass
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from a local ``tokenizer.json``. Without an ``eos_id`` (from
    generation_config.json or config.json), the tokenizer's usual end-of-document token, as
    ``prepare`` inserts it, when it has one."""

    path: pathlib.Path
    eos_id: int | None = None

    def __post_init__(self):
        self._tokenizer = load_tokenizer(self.path, "--tokenizer")
        if self.eos_id is None:
            try:
                self.eos_id = end_of_document_id(self._tokenizer, None, "--tokenizer")[1]
            except ConfigError:  # none of the usual tokens: generate up to --max-new-tokens
                pass

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def generate_tokens(graphdef: nnx.GraphDef, params: nnx.State, prompt: np.ndarray, max_new_tokens: int, *,
                    temperature: float = 0.0, seed: int = 0, stop_id: int | None = None,
                    shard: ActivationSharding = unconstrained) -> np.ndarray:
    """[batch, <= max_new_tokens] tokens following ``prompt`` [batch, length].

    The prompt fills a KV cache in one call; each further token is one call of length 1 at the
    next position. ``temperature`` 0 picks the most likely token, else samples from
    ``softmax(logits / temperature)``. Stops early once every row has produced ``stop_id``.
    """
    length = prompt.shape[1]
    static = {"graphdef": graphdef, "shard": shard}
    device = next((next(iter(leaf.sharding.device_set)) for leaf in jax.tree.leaves(params)
                   if isinstance(leaf, jax.Array)), None)
    check_cache_fits(graphdef, params, prompt.shape, length + max_new_tokens, device, shard=shard)
    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    temperature = jnp.float32(temperature)
    token, cache = _prefill(params, jnp.asarray(prompt, jnp.int32), keys[0], temperature,
                            max_len=length + max_new_tokens, **static)
    tokens = [token]
    for i in range(1, max_new_tokens):
        if stop_id is not None and bool(jnp.all(jnp.any(jnp.stack(tokens) == stop_id, axis=0))):
            break
        token, cache = _step(params, token, cache, jnp.int32(length + i - 1), keys[i], temperature, **static)
        tokens.append(token)
    return np.asarray(jax.device_get(jnp.stack(tokens, axis=1)))


def check_cache_fits(graphdef: nnx.GraphDef, params: nnx.State, prompt_shape: tuple[int, int], max_len: int,
                     device: jax.Device | None, *, shard: ActivationSharding = unconstrained,
                     field: str = "--max-new-tokens") -> None:
    """``ConfigError(field)`` before anything is allocated when the KV cache of ``max_len``
    positions for a prompt [batch, length] (its shapes from the prefill, traced abstractly on
    ``params``, arrays or their shapes) would not fit ``device``'s memory: the cache lives whole on
    every device holding a row of the prompt."""
    available = device_memory_bytes(device) if device is not None else None
    if available is None:
        return
    abstract = jax.eval_shape(functools.partial(_prefill, max_len=max_len, graphdef=graphdef, shard=shard), params,
                              jax.ShapeDtypeStruct(prompt_shape, jnp.int32), jax.random.key(0), jnp.float32(0))
    cache = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract[1]))
    if cache > available:
        raise ConfigError(field, f"a KV cache of {max_len:,} positions needs {format_bytes(cache)} and a "
                          f"device has {format_bytes(available)}; ask for fewer new tokens")


def _pick(logits: jax.Array, key: jax.Array, temperature: jax.Array) -> jax.Array:
    """[batch] next tokens from the last position's logits [batch, length, vocab]: the most likely
    one when ``temperature`` is 0, else a sample of ``softmax(logits / temperature)``."""
    logits = logits[:, -1].astype(jnp.float32)
    sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1)
    return jnp.where(temperature == 0, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)


# Jitted once per (model, shapes, constraint): repeated calls reuse the compilation.
@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "shard"))
def _prefill(params: nnx.State, prompt: jax.Array, key: jax.Array, temperature: jax.Array, *,
             graphdef: nnx.GraphDef, max_len: int, shard: ActivationSharding) -> tuple[jax.Array, Any]:
    model = nnx.merge(graphdef, params)
    logits, cache = model.cached_forward(prompt, model.init_cache(prompt.shape[0], max_len), jnp.int32(0), shard)
    return _pick(logits, key, temperature), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "shard"))
def _step(params: nnx.State, token: jax.Array, cache: Any, position: jax.Array, key: jax.Array,
          temperature: jax.Array, *, graphdef: nnx.GraphDef, shard: ActivationSharding
          ) -> tuple[jax.Array, Any]:
    logits, cache = nnx.merge(graphdef, params).cached_forward(token[:, None], cache, position, shard)
    return _pick(logits, key, temperature), cache
