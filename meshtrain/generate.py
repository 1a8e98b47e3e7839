"""``python -m meshtrain.generate --run RUN_DIR (or --hf DIR) --prompt "..."``

Greedy (``--temperature 0``, the default) or temperature sampling with a KV cache, enough to
sanity-check a model. Tokenizer (``--tokenizer``): ``auto`` uses the ``tokenizer.json`` of the model's
directory (a run directory records the one its data was tokenized with; an export and an HF
directory carry theirs), else UTF-8 bytes as ids 0..255 for a model trained on ``data.source=text``,
and refuses any other model (its ids are not bytes); ``bytes`` forces byte ids; or a path to a
``tokenizer.json``.
Prints the prompt followed by the generated text. Bad input prints one ``error: field: what is
wrong`` line and exits 2.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import sys
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain import jsonio
from meshtrain.data.tokenizer import TOKENIZER_FILE, end_of_document_id, load_tokenizer
from meshtrain.loading import LoadedModel, load_model, mesh_from_args
from meshtrain.errors import ConfigError
from meshtrain.mesh import device_memory_bytes
from meshtrain.metrics import format_bytes
from meshtrain.parallel.sharding import data_parallel_size
from meshtrain.cli import ArgumentParser, add_mesh_arguments, run
from models.api import CachedDecoder, family_of
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


def _eos_id(model_dir: pathlib.Path, hf_config: dict | None) -> int | None:
    """The end-of-sequence id from generation_config.json or config.json (the first of a list)."""
    sources = []
    if (model_dir / "generation_config.json").is_file():
        try:
            sources.append(jsonio.loads((model_dir / "generation_config.json").read_text()))
        except ValueError:
            pass
    sources.append(hf_config or {})
    for source in sources:
        eos = source.get("eos_token_id")
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if isinstance(eos, int):
            return eos
    return None


def make_tokenizer(choice: str, model: LoadedModel) -> Tokenizer:
    """The tokenizer ``--tokenizer`` names for ``model`` (see the module docstring)."""
    model_dir = model.home or (model.path if model.path.is_dir() else model.path.parent)
    if choice == "auto":
        if (model_dir / TOKENIZER_FILE).is_file():
            choice = str(model_dir / TOKENIZER_FILE)
        elif model.trained_on_bytes:
            choice = "bytes"
        else:
            learned = ("was not trained on bytes (data.source=text)" if model.trained_on_bytes is False
                       else "does not say it was trained on bytes")
            raise ConfigError("--tokenizer", f"{model_dir} holds no {TOKENIZER_FILE} and {learned}, so byte ids "
                              "would be wrong; give --tokenizer PATH/tokenizer.json (or bytes to force them)")
    if choice == "bytes":
        if model.cfg.vocab_size < 256:
            raise ConfigError("--tokenizer", f"bytes need a vocabulary of at least 256, but the model has "
                              f"{model.cfg.vocab_size}; give a tokenizer.json")
        return ByteTokenizer()
    path = pathlib.Path(choice)
    if not path.is_file():
        raise ConfigError("--tokenizer", f"no such file: {choice}; use auto, bytes or a tokenizer.json path")
    return HFTokenizer(path, eos_id=_eos_id(model_dir, model.hf_config))


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
    _check_cache_memory(params, prompt, length + max_new_tokens, static)
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


def _check_cache_memory(params: nnx.State, prompt: np.ndarray, max_len: int, static: dict) -> None:
    """``ConfigError("--max-new-tokens")`` before anything is allocated when the KV cache of
    ``max_len`` positions (its shapes from the prefill, traced abstractly) would not fit a device's
    memory: the cache lives whole on every device holding a row of the prompt."""
    device = next((next(iter(leaf.sharding.device_set)) for leaf in jax.tree.leaves(params)
                   if isinstance(leaf, jax.Array)), None)
    available = device_memory_bytes(device) if device is not None else None
    if available is None:
        return
    abstract = jax.eval_shape(functools.partial(_prefill, max_len=max_len, **static), params,
                              jax.ShapeDtypeStruct(prompt.shape, jnp.int32), jax.random.key(0), jnp.float32(0))
    cache = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract[1]))
    if cache > available:
        raise ConfigError("--max-new-tokens", f"a KV cache of {max_len:,} positions needs {format_bytes(cache)} and a "
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


def generate_text(model: LoadedModel, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, *,
                  temperature: float = 0.0, seed: int = 0) -> str:
    """The text ``model`` continues ``prompt`` with (up to the end-of-sequence token)."""
    if not isinstance(model.module(), CachedDecoder):
        raise ConfigError("--run", f"model family {family_of(model.cfg).name!r} has no KV-cache path "
                          "(init_cache / cached_forward); generation needs one")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ConfigError("--prompt", "encodes to no tokens; give a non-empty prompt")
    if max(ids) >= model.cfg.vocab_size:
        raise ConfigError("--tokenizer", f"gives id {max(ids)}, outside the model's vocabulary "
                          f"[0, {model.cfg.vocab_size})")
    rows = data_parallel_size(model.rules, model.mesh.shape)  # the batch is split that many ways
    new = generate_tokens(model.graphdef, model.params, np.asarray([ids] * rows), max_new_tokens,
                          temperature=temperature, seed=seed, stop_id=tokenizer.eos_id, shard=model.shard)[0]
    new = list(new)
    if tokenizer.eos_id is not None and tokenizer.eos_id in new:
        new = new[:new.index(tokenizer.eos_id)]
    return tokenizer.decode(new)


def _parse_args(argv: list[str] | None):
    parser = ArgumentParser(prog="python -m meshtrain.generate", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="meshtrain run directory, step directory or export")
    source.add_argument("--hf", help="Hugging Face model directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tokenizer", default="auto", help="auto, bytes or a tokenizer.json path")
    parser.add_argument("--step", type=int, help="checkpoint step of a run (default: the latest)")
    add_mesh_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, print_fn: Callable[[str], None] = print) -> int:

    def generate(argv: list[str] | None) -> None:
        args = _parse_args(argv)
        if args.max_new_tokens < 1:
            raise ConfigError("--max-new-tokens", f"must be a positive integer, got {args.max_new_tokens}")
        if not 0 <= args.seed < 2 ** 32:
            raise ConfigError("--seed", f"must be an integer in [0, 2**32), got {args.seed}")
        if not (math.isfinite(args.temperature) and args.temperature >= 0):
            raise ConfigError("--temperature", f"must be a finite number >= 0 (0 = greedy), got {args.temperature}")
        mesh, rules = mesh_from_args(args)
        model = load_model(args.run or args.hf, mesh, rules, step=args.step,
                           field="--run" if args.run else "--hf")
        tokenizer = make_tokenizer(args.tokenizer, model)
        text = generate_text(model, tokenizer, args.prompt, args.max_new_tokens,
                             temperature=args.temperature, seed=args.seed)
        if jax.process_index() == 0:
            print_fn(args.prompt + text)

    return run(generate, argv)


if __name__ == "__main__":
    sys.exit(main())
