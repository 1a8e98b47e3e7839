"""``python -m meshtrain.logits --model DIR --tokens ids.npy --out logits.npy [--host-devices N] [mesh.*=...]``

Writes the fp32 logits ``[batch, length, vocab]`` of a batch of token ids (``.npy``, integer,
``[batch, length]`` or ``[length]``) for a meshtrain run, step directory, export or HF directory:
for comparing with other implementations and for evaluation scripts. The model is loaded onto the
mesh (default ``fsdp`` over every device) and run in fp32 with full-precision matmuls. Bad input
prints one ``error: field: what is wrong`` line and exits 2.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from meshtrain.cli import ArgumentParser, add_mesh_arguments, add_trust_plugin_argument, output_file, run
from meshtrain.errors import ConfigError
from meshtrain.parallel.sharding import BATCH_AXES
from meshtrain.weights.loading import LoadedModel, load_model, mesh_from_args
from models.api import forward


def read_tokens(path: str, vocab_size: int, *, field: str = "--tokens") -> np.ndarray:
    """int32 [batch, length] token ids from an ``.npy`` file, checked against the vocabulary."""
    try:
        tokens = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ConfigError(field, f"cannot read {path} as .npy: {err}") from None
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(field, f"{path} holds {tokens.dtype}; token ids must be integers")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.size == 0:
        raise ConfigError(field, f"{path} has shape {list(tokens.shape)}; expected [batch, length] or [length]")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ConfigError(field, f"{path} holds ids in [{tokens.min()}, {tokens.max()}], outside the "
                          f"model's vocabulary [0, {vocab_size})")
    return tokens.astype(np.int32)


def compute_logits(model: LoadedModel, tokens: np.ndarray) -> np.ndarray:
    """fp32 logits [batch, length, vocab] of ``tokens`` [batch, length].

    Rows are padded to a multiple of the data-parallel size (the padding is dropped again).
    """
    batch = tokens.shape[0]
    rows = model.rules.data_parallel_size(model.mesh.shape)
    padded = np.zeros((-(-batch // rows) * rows, tokens.shape[1]), np.int32)
    padded[:batch] = tokens
    sharding = NamedSharding(model.mesh, model.rules.activation_spec(BATCH_AXES))
    graphdef, shard = model.graphdef, model.shard

    @jax.jit
    def logits_of(params: nnx.State, tokens: jax.Array) -> jax.Array:
        return forward(nnx.merge(graphdef, params), tokens, shard).astype(jnp.float32)

    with jax.default_matmul_precision("highest"):
        logits = logits_of(model.params, jax.device_put(padded, sharding))
    return np.asarray(jax.device_get(logits))[:batch]


def _parse_args(argv: list[str] | None):
    parser = ArgumentParser(prog="python -m meshtrain.logits", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="run directory, step directory, export or HF directory")
    parser.add_argument("--tokens", required=True, help=".npy of integer token ids, [batch, length] or [length]")
    parser.add_argument("--out", required=True, help=".npy file to write the fp32 logits to")
    parser.add_argument("--step", type=int, help="checkpoint step of a run (default: the latest)")
    add_mesh_arguments(parser)
    add_trust_plugin_argument(parser)
    return parser.parse_args(argv)


def _write_logits(argv: list[str] | None) -> None:
    args = _parse_args(argv)
    mesh, rules = mesh_from_args(args)
    out = output_file(args.out, ".npy", " (numpy would otherwise write to another name)")
    model = load_model(args.model, mesh, rules, step=args.step, trust_plugin=args.trust_plugin)
    tokens = read_tokens(args.tokens, model.cfg.vocab_size)
    logits = compute_logits(model, tokens)
    if jax.process_index() == 0:
        np.save(out, logits)
        print(f"wrote fp32 logits {list(logits.shape)} to {out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    return run(_write_logits, argv)


if __name__ == "__main__":
    sys.exit(main())
