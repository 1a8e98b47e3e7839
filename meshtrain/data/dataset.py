"""What every token source shares: the ``TokenDataset`` interface, the seed-stream tags, and the
helpers that turn windows of ``seq_len + 1`` tokens into rows (inputs, targets, mask)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

# Domain tags put first in every SeedSequence entropy list, so the chain, the example streams and
# the shuffle never share a stream (SeedSequence pads short lists with zeros: [s] == [s, 0]).
CHAIN_STREAM = 0x6D61726B
EXAMPLE_STREAM = 0x65786D70
SHUFFLE_STREAM = 0x73687566
HELD_OUT_STREAM = 0x68656C64  # markov evaluation examples: the same chain, another sample stream


class TokenDataset(Protocol):
    """Random access to examples of ``seq_len + 1`` consecutive tokens."""

    seq_len: int
    entropy_floor: float | None  # exact best-possible loss in nats/target, if known
    bytes_per_token: float | None  # UTF-8 text bytes per token, where known (bits per byte)
    tokenizer_file: str | None  # the tokenizer.json the ids come from, where known

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Examples for global indices int64 [n]: inputs/targets int32 [n, seq_len], mask f32; with
        ``packing: documents`` also positions/segments int32 [n, seq_len]."""

    def describe(self) -> str:
        """One line for the start-up log."""


def as_rows(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Splits examples int [n, seq_len+1] into inputs, targets (shifted by one) and mask."""
    tokens = np.asarray(tokens, dtype=np.int32)
    return {
        "inputs": np.ascontiguousarray(tokens[:, :-1]),
        "targets": np.ascontiguousarray(tokens[:, 1:]),
        "mask": np.ones((tokens.shape[0], tokens.shape[1] - 1), np.float32),
    }


def check_indices(indices: np.ndarray) -> np.ndarray:
    """``indices`` as int64 [n], all >= 0; a ValueError otherwise."""
    indices = np.asarray(indices, dtype=np.int64)
    if indices.ndim != 1 or (indices.size and indices.min() < 0):
        raise ValueError(f"indices must be non-negative int64 [n], got shape {indices.shape}")
    return indices
