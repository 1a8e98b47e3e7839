"""Training data: token sources and the sharded global batch.

Every example is a deterministic function of ``(DataConfig.seed, example index)`` only, so any
process can build any rows without coordination, and the batch of step ``s`` is the same whatever
the mesh or the number of processes. Three sources:

* ``markov``: an embedded, generated order-2 Markov chain (no download) with an exactly known
  entropy floor, so a training run can be judged against the best achievable loss.
* ``text``: local files read as bytes (byte-level tokens 0..255).
* ``tokens``: a prepared directory (``python -m meshtrain.data prepare``: token shards, document
  boundaries, its tokenizer; ``meshtrain/data/corpus.py``), or pre-tokenised ids in one ``.npy`` or
  raw ``.bin`` file; ``data.mixture`` draws from several with weights.

Windows (``data.packing``): ``concat`` cuts the token stream into windows of ``seq_len + 1`` and
drops the incomplete tail; ``documents`` (prepared directories) takes the same windows, pads the
tail, and adds per-token ``positions`` and ``segments`` (``models.api.Documents``) so that no token
attends across a document boundary, positions restart at each document, and no target is the first
token of a document predicted from the one before (its ``mask`` is 0, as is padding's).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import glob
import math
import os
import stat
import sys
from typing import Protocol
from collections.abc import Callable

import grain
import jax
import numpy as np

from meshtrain.data.corpus import CorpusSplit, PreparedCorpus, is_prepared_dir
from meshtrain.data.tokenizer import file_sha256, load_tokenizer, tokenizer_file
from meshtrain.errors import ConfigError

# Domain tags put first in every SeedSequence entropy list, so the chain, the example streams and
# the shuffle never share a stream (SeedSequence pads short lists with zeros: [s] == [s, 0]).
_CHAIN_STREAM = 0x6D61726B
_EXAMPLE_STREAM = 0x65786D70
_SHUFFLE_STREAM = 0x73687566
_HELD_OUT_STREAM = 0x68656C64  # markov evaluation examples: the same chain, another sample stream
TRAIN_SPLIT = "train"

_TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")
_MAX_CHECK_CHUNK = 1 << 24  # tokens per chunk when scanning a file for its largest id
_WEIGHT_RATIO = 3.0  # successor j of a context has weight proportional to _WEIGHT_RATIO ** -j
_STATIONARY_TOL = 1e-15  # L1 change per power-iteration step at which the chain counts as mixed
_STATIONARY_MAX_ITERS = 200_000


class DataSource(str, enum.Enum):
    """Where tokens come from."""

    MARKOV = "markov"  # generated order-2 Markov chain (default; needs no files)
    TEXT = "text"  # local text files as bytes: tokens 0..255
    TOKENS = "tokens"  # a prepared directory, or pre-tokenised ids: .npy (memory-mapped) or raw .bin


class Packing(str, enum.Enum):
    """How windows relate to documents (see the module docstring)."""

    CONCAT = "concat"  # windows of the concatenated stream; attention runs across documents
    DOCUMENTS = "documents"  # the same windows, masked and positioned per document; tail padded


@dataclasses.dataclass(frozen=True)
class MixtureEntry:
    """One dataset of ``data.mixture``: a prepared directory (or ``.npy``/``.bin``) and its weight."""

    path: str
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The ``data`` section of a run config.

    Attributes:
      source: where tokens come from.
      path: for ``text``: a file, a directory (all files below it) or a glob, concatenated in
        sorted path order; for ``tokens``: a prepared directory (its ``train`` split) or one
        ``.npy`` or ``.bin`` file; empty for ``markov`` and with ``mixture``.
      token_dtype: element type of a ``.bin`` file (one of ``uint8 uint16 uint32 int32 int64``).
      seed: data order (file sources) or chain and sample (markov) seed, in [0, 2**32).
      markov_branching: likely successors per context of the markov chain; the j-th has weight
        proportional to 3**-j, rotated by a class of the older context token (see MarkovDataset).
      markov_noise: probability that the markov chain instead emits a uniformly random token; it
        must be > 0 so that the chain has a unique stationary distribution.
      packing: ``concat`` or ``documents`` (needs prepared directories: they record the boundaries).
      tokenizer: a ``tokenizer.json`` (or a directory holding one) the ids come from. For a prepared
        directory it defaults to the directory's own and, when given, must be the same file; it is
        copied into the run directory, where ``meshtrain.generate --tokenizer auto`` finds it.
      mixture: for ``tokens``: several datasets drawn with these weights (normalised), example ``i``
        from dataset ``d`` by grain's deterministic weighted interleave, so the batches depend on
        ``(seed, step)`` only; each dataset shuffles its own windows.
    """

    source: DataSource = DataSource.MARKOV
    path: str = ""
    token_dtype: str = "uint16"
    seed: int = 0
    markov_branching: int = 4
    markov_noise: float = 0.01
    packing: Packing = Packing.CONCAT
    tokenizer: str = ""
    mixture: tuple[MixtureEntry, ...] = ()

    def __post_init__(self):
        valid_sources = ", ".join(repr(s.value) for s in DataSource)
        if not isinstance(self.source, DataSource):
            raise ConfigError("source", f"got {self.source!r}; valid: {valid_sources}")
        if self.source is DataSource.MARKOV and self.path:
            raise ConfigError(
                "path", "must be empty when source is 'markov' (it reads no files); "
                "use source 'text' or 'tokens' to train on files")
        if self.mixture:
            if self.source is not DataSource.TOKENS:
                raise ConfigError("mixture", f"needs source 'tokens', got {self.source.value!r}")
            if self.path:
                raise ConfigError("path", "must be empty with data.mixture (each entry names its path)")
            for i, entry in enumerate(self.mixture):
                if not entry.path:
                    raise ConfigError(f"mixture[{i}].path", "must name a prepared directory or .npy/.bin file")
                if not isinstance(entry.weight, (int, float)) or not 0 < entry.weight < math.inf:
                    raise ConfigError(f"mixture[{i}].weight", f"got {entry.weight!r}; must be a finite number > 0")
        elif self.source is not DataSource.MARKOV and not self.path:
            raise ConfigError(
                "path", f"required when source is {self.source.value!r}: "
                + ("a file, directory or glob of text files" if self.source is DataSource.TEXT
                   else "a prepared directory or a .npy or .bin file of token ids"))
        if not isinstance(self.packing, Packing):
            raise ConfigError("packing", f"got {self.packing!r}; valid: 'concat', 'documents'")
        if self.packing is Packing.DOCUMENTS and self.source is not DataSource.TOKENS:
            raise ConfigError("packing", f"'documents' needs source 'tokens' from a prepared directory "
                              f"(it records the document boundaries), got source {self.source.value!r}")
        if self.tokenizer and self.source is not DataSource.TOKENS:
            raise ConfigError("tokenizer", f"only applies to source 'tokens' (source {self.source.value!r} "
                              "has no tokenizer)")
        if self.token_dtype not in _TOKEN_DTYPES:
            raise ConfigError("token_dtype", f"got {self.token_dtype!r}; valid: "
                              + ", ".join(_TOKEN_DTYPES))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ConfigError("seed", f"got {self.seed!r}; must be an integer in [0, 2**32)")
        if (isinstance(self.markov_branching, bool) or not isinstance(self.markov_branching, int)
                or self.markov_branching < 1):
            raise ConfigError("markov_branching", f"got {self.markov_branching!r}; "
                              "must be an integer >= 1 (and < model.vocab_size)")
        if not isinstance(self.markov_noise, (int, float)) or not 0.0 < self.markov_noise < 1.0:
            raise ConfigError("markov_noise", f"got {self.markov_noise!r}; must be a number in "
                              "(0, 1) (0 would allow a non-unique stationary distribution)")


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


def _as_rows(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Splits examples int [n, seq_len+1] into inputs, targets (shifted by one) and mask."""
    tokens = np.asarray(tokens, dtype=np.int32)
    return {
        "inputs": np.ascontiguousarray(tokens[:, :-1]),
        "targets": np.ascontiguousarray(tokens[:, 1:]),
        "mask": np.ones((tokens.shape[0], tokens.shape[1] - 1), np.float32),
    }


def _distinct_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """int64 [rows, k]: k distinct random tokens of [0, rows) per row, in O(rows * k)."""
    out = rng.integers(0, rows, (rows, k))
    while True:
        ordered = np.sort(out, 1)
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(1)
        if not repeated.any():
            return out
        out[repeated] = rng.integers(0, rows, (int(repeated.sum()), k))


def _check_indices(indices: np.ndarray) -> np.ndarray:
    indices = np.asarray(indices, dtype=np.int64)
    if indices.ndim != 1 or (indices.size and indices.min() < 0):
        raise ValueError(f"indices must be non-negative int64 [n], got shape {indices.shape}")
    return indices


class MarkovDataset:
    """A fixed random order-2 Markov chain over ``vocab_size`` tokens, built from ``seed``.

    Chain: every token ``b`` has ``K = branching`` distinct random successors ``successors[b]``
    and a random class ``token_class[b]`` in [0, K). After the context ``(a, b)`` (``b`` newest)
    the next token is ``successors[b, (j + token_class[a]) % K]`` with probability
    ``(1 - noise) * weights[j]`` (weights proportional to 3**-j: few, peaked successors), plus
    ``noise / vocab_size`` for every token. The newest token fixes the candidate set (learnable
    as a bigram), the older token's class fixes their order (the order-2 part), and the noise
    makes the chain irreducible and aperiodic.

    Because the next token depends on ``a`` only through ``token_class[a]``, the chain on
    ``(token_class[a], b)`` (K * vocab states) is Markov; its stationary distribution, found by
    sparse power iteration to float64 precision, gives the exact stationary pair distribution
    ``P(a, b) = marginal[a] * noise / vocab + successor_mass[a, c]`` for ``b = successors[a, c]``
    (``pair_prob``). Each example starts with ``(x0, x1)`` drawn from it (``x0`` from the marginal,
    then ``x1`` given ``x0``, by inverting the CDFs with one uniform) and continues with the chain,
    all from ``np.random.default_rng`` keyed by ``(seed, index)``. Memory and set-up time are
    linear in the vocabulary (O(vocab * K)).

    Attributes:
      successors: int64 [vocab, K]; token_class: int64 [vocab]; weights: float64 [K].
      marginal: float64 [vocab], stationary P(x_t = a); successor_mass: float64 [vocab, K], the
        chain's share of P(x_t = a, x_{t+1} = successors[a, c]).
      entropy_floor: expected loss of the true conditional over the seq_len targets (the first
        target sees only x0 and is predicted by ``P(x0, .) / marginal[x0]``).
    """

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, branching: int, noise: float):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.branching, self.noise = branching, float(noise)
        v, k = vocab_size, branching
        rng = np.random.default_rng([_CHAIN_STREAM, seed])
        self.successors = _distinct_rows(rng, v, k)
        self.token_class = rng.integers(0, k, size=v)
        weights = _WEIGHT_RATIO ** -np.arange(k, dtype=np.float64)
        self.weights = weights / weights.sum()
        # rotated[r, b, j]: the token emitted with weight j after a class-r token and then b.
        rotation = (np.arange(k)[:, None] + np.arange(k)[None, :]) % k  # [r, j]
        self._rotated = self.successors[:, rotation].transpose(1, 0, 2)  # [K, vocab, K]
        pi = self._stationary_states()  # [K, vocab]
        self.marginal = pi.sum(0)
        # successors[a, c] is emitted after (class r, a) with weight index j = (c - r) mod K.
        by_offset = self.weights[(np.arange(k)[None, :] - np.arange(k)[:, None]) % k]  # [r, c]
        self.successor_mass = (1 - self.noise) * pi.T @ by_offset  # [vocab, K]
        self._marginal_cdf = np.cumsum(self.marginal)
        self._successor_cdf = np.cumsum(self.successor_mass / ((1 - self.noise) * self.marginal[:, None]), 1)
        self._sample_cdf = np.cumsum(self.weights)
        self.entropy_floor = self._entropy_floor()
        self.sample_stream = _EXAMPLE_STREAM

    bytes_per_token = None
    tokenizer_file = None

    def held_out(self) -> MarkovDataset:
        """The same chain sampled from another stream: examples no training step sees."""
        held_out = copy.copy(self)
        held_out.sample_stream = _HELD_OUT_STREAM
        return held_out

    def _stationary_states(self) -> np.ndarray:
        """Exact stationary distribution [K, vocab] of the state (class of the older token, newest
        token), by power iteration."""
        v, k, eps = self.vocab_size, self.branching, self.noise
        # State (r, b) flattened r * v + b. From (r, b) the chain emits rotated[r, b, j] w.p.
        # (1-eps) w_j and moves to (class[b], c).
        src = np.repeat(np.arange(k * v), k)
        dst = (self.token_class[None, :, None] * v + self._rotated).ravel()
        weight = np.tile((1 - eps) * self.weights, k * v)
        pi = np.full(k * v, 1.0 / (k * v))
        for _ in range(_STATIONARY_MAX_ITERS):
            mass_b = pi.reshape(k, v).sum(0)  # P(newest token = b)
            noise_by_class = np.bincount(self.token_class, weights=mass_b, minlength=k) * eps / v
            nxt = np.bincount(dst, weights=pi[src] * weight, minlength=k * v)
            nxt = (nxt.reshape(k, v) + noise_by_class[:, None]).ravel()
            nxt /= nxt.sum()
            delta = np.abs(nxt - pi).sum()
            pi = nxt
            if delta < _STATIONARY_TOL:
                return pi.reshape(k, v)
        raise RuntimeError(f"markov chain did not mix in {_STATIONARY_MAX_ITERS} steps")

    def pair_prob(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Stationary P(x_t = a, x_{t+1} = b) float64 for token arrays ``a``, ``b`` of one shape."""
        a, b = np.asarray(a), np.asarray(b)
        chained = np.where(self.successors[a] == b[..., None], self.successor_mass[a], 0.0).sum(-1)
        return self.marginal[a] * self.noise / self.vocab_size + chained

    def _entropy_floor(self) -> float:
        """Exact mean over the seq_len targets of H(target | all earlier tokens), in nats."""
        v, k, eps = self.vocab_size, self.branching, self.noise
        uniform = eps / v
        # H(x1 | x0 = a): K successors with uniform + mass / marginal, the other v - K uniform.
        chained = uniform + self.successor_mass / self.marginal[:, None]
        per_token = -np.sum(chained * np.log(chained), 1) - (v - k) * uniform * math.log(uniform)
        first = float(np.dot(self.marginal, per_token))
        likely = (1 - eps) * self.weights + uniform
        # Every context has the same multiset of next-token probabilities.
        later = -np.sum(likely * np.log(likely)) - (v - k) * uniform * math.log(uniform)
        return float((first + (self.seq_len - 1) * later) / self.seq_len)

    def transition_probs(self, prev2: np.ndarray, prev1: np.ndarray) -> np.ndarray:
        """True P(next | prev2, prev1) float64 [n, vocab] for contexts int [n] and [n]."""
        prev2, prev1 = np.asarray(prev2), np.asarray(prev1)
        probs = np.full((prev1.shape[0], self.vocab_size), self.noise / self.vocab_size)
        emitted = self._rotated[self.token_class[prev2], prev1]  # [n, K]
        probs[np.arange(prev1.shape[0])[:, None], emitted] += (1 - self.noise) * self.weights
        return probs

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Examples for global indices int64 [n]; see TokenDataset.rows."""
        indices = _check_indices(indices)
        n, v, steps = indices.shape[0], self.vocab_size, self.seq_len + 1
        uniforms = np.stack([np.random.default_rng([self.sample_stream, self.seed, int(i)])
                             .random(steps - 1) for i in indices]) if n else np.zeros((0, steps - 1))
        tokens = np.empty((n, steps), np.int64)
        tokens[:, 0], tokens[:, 1] = self._first_pairs(uniforms[:, 0])
        for t in range(2, steps):
            u = uniforms[:, t - 1]
            noisy = u < self.noise
            u_rest = (u - self.noise) / (1 - self.noise)
            j = np.minimum(np.searchsorted(self._sample_cdf, u_rest, side="right"), self.branching - 1)
            chained = self._rotated[self.token_class[tokens[:, t - 2]], tokens[:, t - 1], j]
            uniform = np.minimum((u / self.noise * v).astype(np.int64), v - 1)
            tokens[:, t] = np.where(noisy, uniform, chained)
        return _as_rows(tokens)

    def _first_pairs(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(x0, x1) [n] each, exactly from the stationary pair distribution, one uniform per pair:
        x0 by the marginal's CDF, then the uniform's position within x0's slice picks x1."""
        v, eps = self.vocab_size, self.noise
        first = np.minimum(np.searchsorted(self._marginal_cdf, u, side="right"), v - 1)
        below = np.where(first > 0, self._marginal_cdf[np.maximum(first - 1, 0)], 0.0)
        within = np.clip((u - below) / self.marginal[first], 0.0, np.nextafter(1.0, 0.0))
        noisy = within < eps
        uniform = np.minimum((within / eps * v).astype(np.int64), v - 1)
        rest = (within - eps) / (1 - eps)
        column = (self._successor_cdf[first] <= rest[:, None]).sum(1)  # searchsorted, row by row
        chained = self.successors[first, np.minimum(column, self.branching - 1)]
        return first, np.where(noisy, uniform, chained)

    def describe(self) -> str:
        return (f"data: markov order-2 chain, vocab {self.vocab_size}, {self.branching} successors/"
                f"context, noise {self.noise:g}, seed {self.seed}; generated examples of "
                f"{self.seq_len + 1} tokens; entropy floor {self.entropy_floor:.4f} nats/token "
                f"(uniform {math.log(self.vocab_size):.4f})")


class TokenStream(Protocol):
    """A split's tokens as one stream: a prepared split (``CorpusSplit``) or an ``ArrayStream``."""

    num_tokens: int

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [stop - start] of the stream."""


class ArrayStream:
    """A 1-D token array (memory-mapped from a file, or in memory) as a ``TokenStream``."""

    def __init__(self, array: np.ndarray):
        self.array, self.num_tokens = array, int(array.shape[0])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self.array[start:stop]


@dataclasses.dataclass(frozen=True)
class StreamInfo:
    """What a token stream's source knows about it besides its tokens.

    Attributes:
      label: for the start-up line. watched: files the stream reads, checked for changes before
      every read. document_starts: int64 [documents + 1] offsets where each document starts (last =
      num_tokens), for ``packing: documents``. bytes_per_token, tokenizer_file: see ``TokenDataset``;
      tokenizer_sha256: that file's hash.
    """

    label: str
    watched: tuple[str, ...] = ()
    document_starts: np.ndarray | None = None
    bytes_per_token: float | None = None
    tokenizer_file: str | None = None
    tokenizer_sha256: str | None = None


class FileDataset:
    """Windows of ``seq_len + 1`` tokens of a token stream, shuffled per epoch (or in order).

    Example ``i`` is window ``perm_e(i % num_windows)`` of epoch ``e = i // num_windows``, where
    ``perm_e`` is grain's seeded index shuffle (a different permutation every epoch); unshuffled
    (``shuffle=False``, evaluation) example ``i`` is window ``i % num_windows``. Without document
    boundaries the incomplete tail is dropped; with them (``packing: documents``) it is padded with
    token 0 in segment 0, masked.
    """

    entropy_floor = None

    def __init__(self, stream: TokenStream, info: StreamInfo, *, seq_len: int, seed: int, shuffle: bool = True):
        self.stream, self.info, self.seq_len = stream, info, seq_len
        self.bytes_per_token, self.tokenizer_file = info.bytes_per_token, info.tokenizer_file
        # A memory-mapped file that shrinks under the run would kill it with SIGBUS on the next read:
        # its identity is checked before every read instead (one stat call per file).
        self._identities = {path: _identity(path) for path in info.watched}
        window = seq_len + 1
        self.num_windows = (stream.num_tokens // window if info.document_starts is None
                            else -(-stream.num_tokens // window))
        order = grain.MapDataset.range(self.num_windows)
        if shuffle:
            shuffle_seed = int(np.random.SeedSequence([_SHUFFLE_STREAM, seed]).generate_state(1)[0])
            order = order.shuffle(seed=shuffle_seed)
        self._order = order.repeat()

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """Window numbers int64 [n] of global example indices int64 [n]."""
        return np.array([self._order[int(i)] for i in _check_indices(indices)], np.int64)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Examples for global indices int64 [n]; see TokenDataset.rows.

        Raises:
          DataChanged: a memory-mapped token file was truncated, replaced or rewritten.
        """
        for path, identity in self._identities.items():
            now = _identity(path)
            if now != identity:
                change = f"{identity[0]} -> {now[0]} bytes" if now[0] != identity[0] else "rewritten or replaced"
                raise DataChanged("data.path", f"{path} changed while training ({change})")
        window, total = self.seq_len + 1, self.stream.num_tokens
        starts = self.windows(indices) * window
        tokens = np.zeros((starts.shape[0], window), np.int64)
        for row, start in enumerate(starts):
            piece = self.stream.tokens(int(start), min(int(start) + window, total))
            tokens[row, :piece.shape[0]] = piece
        rows = _as_rows(tokens)
        if self.info.document_starts is not None:
            rows.update(_document_layout(starts, window, self.info.document_starts, total))
        return rows

    def describe(self) -> str:
        packing = "documents" if self.info.document_starts is not None else "concat"
        return (f"data: {self.info.label}: {self.stream.num_tokens:,} tokens, {self.num_windows:,} "
                f"windows of {self.seq_len + 1}, packing {packing}; entropy floor unknown")


def _document_layout(starts: np.ndarray, window: int, document_starts: np.ndarray,
                     num_tokens: int) -> dict[str, np.ndarray]:
    """mask f32, positions and segments int32, each [n, window - 1], of the windows beginning at
    ``starts`` [n]: a target counts only when it continues the document of its input; positions
    count from the document's first token in the window; segments number the window's documents
    from 1; padding (past the stream's end) is segment 0, masked."""
    index = starts[:, None] + np.arange(window)  # [n, window] positions in the stream
    valid = index < num_tokens
    document = np.searchsorted(document_starts, index, side="right") - 1
    first = np.maximum(document_starts[document], starts[:, None])
    positions = np.where(valid, index - first, 0)
    segments = np.where(valid, document - document[:, :1] + 1, 0)
    mask = (document[:, 1:] == document[:, :-1]) & valid[:, 1:]
    return {"mask": mask.astype(np.float32), "positions": positions[:, :-1].astype(np.int32),
            "segments": segments[:, :-1].astype(np.int32)}


class MixtureDataset:
    """Examples drawn from several datasets with weights: example ``i`` is example ``j`` of dataset
    ``d``, with ``(d, j)`` from grain's deterministic weighted interleave (``MapDataset.mix``: every
    prefix holds each dataset in proportion to its weight, to within one example)."""

    entropy_floor = None

    def __init__(self, datasets: list[TokenDataset], weights: list[float], labels: list[str]):
        self.datasets, self.seq_len = datasets, datasets[0].seq_len
        self.weights = [w / sum(weights) for w in weights]
        self.labels = labels
        sources = [grain.MapDataset.range(sys.maxsize).map(functools.partial(_tagged, d))
                   for d in range(len(datasets))]
        self._mixed = grain.MapDataset.mix(sources, self.weights)
        self.tokenizer_file = datasets[0].tokenizer_file
        per_byte = [d.bytes_per_token for d in datasets]
        self.bytes_per_token = None if None in per_byte else float(np.dot(self.weights, per_byte))

    def sources(self, indices: np.ndarray) -> np.ndarray:
        """int64 [n, 2]: (dataset, its example) of each global example index."""
        return np.array([self._mixed[int(i)] for i in _check_indices(indices)], np.int64).reshape(-1, 2)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        picks = self.sources(indices)
        parts = {d: self.datasets[d].rows(picks[picks[:, 0] == d, 1]) for d in np.unique(picks[:, 0])}
        first = next(iter(parts.values()))
        rows = {key: np.empty((picks.shape[0], *value.shape[1:]), value.dtype) for key, value in first.items()}
        for d, part in parts.items():
            for key, value in part.items():
                rows[key][picks[:, 0] == d] = value
        return rows

    def describe(self) -> str:
        entries = ", ".join(f"{w:.3g} x {label}" for w, label in zip(self.weights, self.labels))
        return f"data: mixture of {len(self.datasets)}: {entries}; entropy floor unknown"


def _tagged(dataset: int, example: int) -> tuple[int, int]:
    return dataset, example


class DataChanged(ConfigError):
    """The data a run reads changed under it (the loop saves and stops with one line)."""


def _identity(path: str) -> tuple[int, int, int]:
    """(size, modification time ns, inode) of ``path``; (-1, -1, -1) when it is gone."""
    try:
        info = os.stat(path)
    except OSError:
        return (-1, -1, -1)
    return (info.st_size, info.st_mtime_ns, info.st_ino)


def _text_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        found = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    else:
        found = glob.glob(path, recursive=True)
    files = sorted(f for f in found if os.path.isfile(f))
    if not files:
        raise ConfigError("data.path", f"no such file, or no files in directory/glob: {path}")
    return files


def _memmapped(array: np.ndarray) -> tuple[str, ...]:
    return (array.filename,) if isinstance(array, np.memmap) and array.filename else ()


def _text_stream(path: str, field: str, vocab_size: int) -> tuple[TokenStream, StreamInfo]:
    if vocab_size < 256:
        raise ConfigError("model.vocab_size", f"is {vocab_size}; source 'text' uses byte tokens "
                          "0..255, so it must be >= 256")
    files = _text_files(path)
    if len(files) == 1:
        size = os.path.getsize(files[0])
        tokens = np.memmap(files[0], np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    else:
        tokens = np.concatenate([np.fromfile(f, np.uint8) for f in files])
    label = f"text bytes from {path} ({len(files)} file{'s' * (len(files) > 1)})"
    return ArrayStream(tokens), StreamInfo(label, _memmapped(tokens), bytes_per_token=1.0)


def _load_npy(path: str, field: str, token_dtype: str) -> np.ndarray:
    del token_dtype
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:  # truncated, header only, random bytes, pickled
        raise ConfigError(field, f"{path} is not a readable .npy array of token ids "
                          f"({' '.join(str(err).split())[:160]})") from None
    if not isinstance(tokens, np.ndarray):
        raise ConfigError(field, f"{path} is not a single .npy array (an .npz archive?)")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ConfigError(field, f"{path} holds {tokens.dtype} {tokens.shape}; "
                          "expected a 1-D integer array of token ids")
    return tokens


def _load_bin(path: str, field: str, token_dtype: str) -> np.ndarray:
    dtype = np.dtype(token_dtype)
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise ConfigError(field, f"{path} has {size} bytes, not a whole number of "
                          f"{token_dtype} tokens; is data.token_dtype right?")
    return np.memmap(path, dtype, mode="r") if size else np.zeros(0, dtype)


_ID_LOADERS: dict[str, Callable[[str, str, str], np.ndarray]] = {".npy": _load_npy, ".bin": _load_bin}


def _check_regular_file(path: str, field: str) -> None:
    """A ConfigError on ``field`` unless ``path`` is a regular file (or a link to one)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        what = "a broken symbolic link" if os.path.islink(path) else "no such file"
        raise ConfigError(field, f"{what}: {path}") from None
    except OSError as err:  # a symlink loop, a name too long, no permission
        raise ConfigError(field, f"cannot open {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "not a regular file")
        raise ConfigError(field, f"{path} is {kind}; give a prepared directory or a .npy or .bin file "
                          "of token ids")


def _check_ids(tokens: np.ndarray, path: str, field: str, vocab_size: int) -> None:
    for start in range(0, tokens.shape[0], _MAX_CHECK_CHUNK):
        chunk = tokens[start:start + _MAX_CHECK_CHUNK]
        low, high = int(chunk.min()), int(chunk.max())
        if high >= vocab_size or low < 0:
            bad = high if high >= vocab_size else low
            raise ConfigError(field, f"token id {bad} in {path} is outside [0, "
                              f"model.vocab_size {vocab_size}); raise model.vocab_size or fix the "
                              "tokenizer/data.token_dtype")


def _given_tokenizer(cfg: DataConfig, vocab_size: int) -> tuple[str, str] | None:
    """(tokenizer.json path, sha256) of ``data.tokenizer``, checked against the vocabulary."""
    if not cfg.tokenizer:
        return None
    tokenizer = load_tokenizer(cfg.tokenizer, "data.tokenizer")
    path = str(tokenizer_file(cfg.tokenizer))
    if tokenizer.get_vocab_size() > vocab_size:
        raise ConfigError("model.vocab_size", f"is {vocab_size}, smaller than the {tokenizer.get_vocab_size()} "
                          f"tokens of data.tokenizer {path}; raise model.vocab_size")
    return path, file_sha256(path)


def _id_stream(cfg: DataConfig, path: str, field: str, vocab_size: int, given: tuple[str, str] | None,
               split: str = TRAIN_SPLIT) -> tuple[TokenStream, StreamInfo]:
    """The token stream at ``path``: a prepared directory's ``split``, or one .npy/.bin file.
    ``given``: ``data.tokenizer``'s (path, sha256) from ``_given_tokenizer``."""
    if os.path.isdir(path):
        corpus = PreparedCorpus.open(path, field=field)
        record = corpus.tokenizer
        if given is not None and given[1] != record.sha256:
            raise ConfigError("data.tokenizer", f"{path} was prepared with another tokenizer ({record.file}, "
                              f"sha256 {record.sha256[:12]}) than data.tokenizer {given[0]} (sha256 "
                              f"{given[1][:12]}); prepare the corpus again with this tokenizer, or drop "
                              "data.tokenizer")
        if record.vocab_size > vocab_size:
            raise ConfigError("model.vocab_size", f"is {vocab_size}, smaller than the {record.vocab_size} "
                              f"tokens of the tokenizer {path} was prepared with; raise model.vocab_size")
        part: CorpusSplit = corpus.split(split, field=field)
        starts = part.document_starts() if cfg.packing is Packing.DOCUMENTS else None
        per_token = part.text_bytes / part.num_tokens if part.text_bytes and part.num_tokens else None
        info = StreamInfo(f"{path} ({split}: {part.num_documents:,} documents)", tuple(part.shard_paths),
                          starts, per_token, record.file, record.sha256)
        return part, info
    if cfg.packing is Packing.DOCUMENTS:
        raise ConfigError("data.packing", f"'documents' needs the document boundaries of a prepared "
                          f"directory (python -m meshtrain.data prepare); {path} is a single file of ids")
    _check_regular_file(path, field)
    load = _ID_LOADERS.get(os.path.splitext(path)[1])
    if load is None:
        raise ConfigError(field, f"{path}: expected a prepared directory or a .npy or .bin file of token ids")
    tokens = load(path, field, cfg.token_dtype)
    _check_ids(tokens, path, field, vocab_size)
    file, digest = given or (None, None)
    return ArrayStream(tokens), StreamInfo(f"tokens from {path}", _memmapped(tokens), tokenizer_file=file,
                                           tokenizer_sha256=digest)


def _file_dataset(stream: TokenStream, info: StreamInfo, path: str, field: str, *, seq_len: int, seed: int,
                  shuffle: bool = True) -> FileDataset:
    if stream.num_tokens < (1 if info.document_starts is not None else seq_len + 1):
        raise ConfigError(field, f"{path} has {stream.num_tokens} tokens; need at least seq_len + 1 = "
                          f"{seq_len + 1}")
    return FileDataset(stream, info, seq_len=seq_len, seed=seed, shuffle=shuffle)


def _markov_dataset(cfg: DataConfig, vocab_size: int, seq_len: int) -> MarkovDataset:
    if cfg.markov_branching >= vocab_size:
        raise ConfigError("data.markov_branching", f"is {cfg.markov_branching}; must be < "
                          f"model.vocab_size {vocab_size}")
    return MarkovDataset(vocab_size=vocab_size, seq_len=seq_len, seed=cfg.seed,
                         branching=cfg.markov_branching, noise=cfg.markov_noise)


def _text_dataset(cfg: DataConfig, vocab_size: int, seq_len: int) -> FileDataset:
    stream, info = _text_stream(cfg.path, "data.path", vocab_size)
    return _file_dataset(stream, info, cfg.path, "data.path", seq_len=seq_len, seed=cfg.seed)


def _tokens_dataset(cfg: DataConfig, vocab_size: int, seq_len: int) -> TokenDataset:
    given = _given_tokenizer(cfg, vocab_size)
    if not cfg.mixture:
        stream, info = _id_stream(cfg, cfg.path, "data.path", vocab_size, given)
        return _file_dataset(stream, info, cfg.path, "data.path", seq_len=seq_len, seed=cfg.seed)
    datasets, hashes = [], []
    for i, entry in enumerate(cfg.mixture):
        field = f"data.mixture[{i}].path"
        stream, info = _id_stream(cfg, entry.path, field, vocab_size, given)
        if hashes and info.tokenizer_sha256 != hashes[0]:
            raise ConfigError(field, f"{entry.path} was tokenized with another tokenizer than "
                              f"{cfg.mixture[0].path}; a mixture needs one tokenizer")
        hashes.append(info.tokenizer_sha256)
        seed = int(np.random.SeedSequence([cfg.seed, i]).generate_state(1)[0])  # each its own order
        datasets.append(_file_dataset(stream, info, entry.path, field, seq_len=seq_len, seed=seed))
    return MixtureDataset(datasets, [entry.weight for entry in cfg.mixture], [e.path for e in cfg.mixture])


_BUILDERS: dict[DataSource, Callable[[DataConfig, int, int], TokenDataset]] = {
    DataSource.MARKOV: _markov_dataset,
    DataSource.TEXT: _text_dataset,
    DataSource.TOKENS: _tokens_dataset,
}


def _check_shape(vocab_size: int, seq_len: int) -> None:
    if vocab_size < 2:
        raise ConfigError("model.vocab_size", f"is {vocab_size}; must be >= 2")
    if seq_len < 1:
        raise ConfigError("model.seq_len", f"is {seq_len}; must be >= 1")


def make_dataset(cfg: DataConfig, *, vocab_size: int, seq_len: int) -> TokenDataset:
    """The training dataset ``cfg`` describes, for a model of ``vocab_size`` and sequences of ``seq_len``.

    Raises:
      ConfigError: with the full dotted field (``data.path``, ``model.vocab_size``, ...).
    """
    _check_shape(vocab_size, seq_len)
    return _BUILDERS[cfg.source](cfg, vocab_size, seq_len)


def make_held_out_dataset(cfg: DataConfig, train: TokenDataset, *, path: str, split: str, field: str,
                          vocab_size: int, seq_len: int) -> TokenDataset:
    """The evaluation examples, in order (window i is example i; no shuffle).

    ``path`` empty: held out from the training data: ``split`` of ``data.path``'s prepared directory,
    or the markov chain's other sample stream. Otherwise ``path``'s ``split`` (a prepared directory),
    or the text or token file(s) at ``path`` read like the training source. ``field`` names ``path``.
    """
    _check_shape(vocab_size, seq_len)
    if isinstance(train, MarkovDataset):
        if path:
            raise ConfigError(field, "the markov source holds its evaluation examples out itself; leave it empty")
        return train.held_out()
    if not path:
        if cfg.source is not DataSource.TOKENS or cfg.mixture or not is_prepared_dir(cfg.path):
            raise ConfigError(field, "needs a path: only a prepared directory (data.path) has a held-out "
                              "split of its own")
        path, field = cfg.path, "data.path"
    if cfg.source is DataSource.TEXT:
        stream, info = _text_stream(path, field, vocab_size)
    else:
        stream, info = _id_stream(cfg, path, field, vocab_size, _given_tokenizer(cfg, vocab_size), split)
    return _file_dataset(stream, info, path, field, seq_len=seq_len, seed=cfg.seed, shuffle=False)


def global_batch(dataset: TokenDataset, step: int, batch_size: int,
                 sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
    """The global batch of ``step``: examples ``step * batch_size + r`` for r in [0, batch_size).

    Each process builds only the rows its addressable devices hold (the span from the smallest to
    the largest row it holds along dim 0) and the arrays are assembled across processes.

    Args:
      sharding: shards dim 0 (batch) over some mesh axes and replicates dim 1.

    Returns:
      ``inputs``/``targets`` int32 and ``mask`` float32 (and, for ``packing: documents``,
      ``positions``/``segments`` int32), each [batch_size, seq_len] with ``sharding``.
    """
    shape = (batch_size, dataset.seq_len)
    spans = [idx[0].indices(batch_size)[:2]
             for idx in sharding.addressable_devices_indices_map(shape).values()]
    start, stop = min(s for s, _ in spans), max(s for _, s in spans)
    local = dataset.rows(step * batch_size + np.arange(start, stop, dtype=np.int64))
    return {name: jax.make_array_from_process_local_data(sharding, rows, shape)
            for name, rows in local.items()}
