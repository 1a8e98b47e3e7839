"""Training data: token sources and the sharded global batch.

Every example is a deterministic function of ``(DataConfig.seed, example index)`` only, so any
process can build any rows without coordination, and the batch of step ``s`` is the same whatever
the mesh or the number of processes. Three sources:

* ``markov``: an embedded, generated order-2 Markov chain (no download) with an exactly known
  entropy floor, so a training run can be judged against the best achievable loss.
* ``text``: local files read as bytes (byte-level tokens 0..255).
* ``tokens``: pre-tokenised ids in a ``.npy`` file or a raw ``.bin`` file.
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import math
import os
import stat
from typing import Callable, Protocol

import grain
import jax
import numpy as np

from meshtrain.errors import ConfigError

# Domain tags put first in every SeedSequence entropy list, so the chain, the example streams and
# the shuffle never share a stream (SeedSequence pads short lists with zeros: [s] == [s, 0]).
_CHAIN_STREAM = 0x6D61726B
_EXAMPLE_STREAM = 0x65786D70
_SHUFFLE_STREAM = 0x73687566

_TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")
_MAX_CHECK_CHUNK = 1 << 24  # tokens per chunk when scanning a file for its largest id
_WEIGHT_RATIO = 3.0  # successor j of a context has weight proportional to _WEIGHT_RATIO ** -j
_STATIONARY_TOL = 1e-15  # L1 change per power-iteration step at which the chain counts as mixed
_STATIONARY_MAX_ITERS = 200_000


class DataSource(str, enum.Enum):
    """Where tokens come from."""

    MARKOV = "markov"  # generated order-2 Markov chain (default; needs no files)
    TEXT = "text"  # local text files as bytes: tokens 0..255
    TOKENS = "tokens"  # pre-tokenised ids: .npy (loaded memory-mapped) or raw .bin


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The ``data`` section of a run config.

    Attributes:
      source: where tokens come from.
      path: for ``text``: a file, a directory (all files below it) or a glob, concatenated in
        sorted path order; for ``tokens``: one ``.npy`` or ``.bin`` file; empty for ``markov``.
      token_dtype: element type of a ``.bin`` file (one of ``uint8 uint16 uint32 int32 int64``).
      seed: data order (file sources) or chain and sample (markov) seed, in [0, 2**32).
      markov_branching: likely successors per context of the markov chain; the j-th has weight
        proportional to 3**-j, rotated by a class of the older context token (see MarkovDataset).
      markov_noise: probability that the markov chain instead emits a uniformly random token; it
        must be > 0 so that the chain has a unique stationary distribution.
    """

    source: DataSource = DataSource.MARKOV
    path: str = ""
    token_dtype: str = "uint16"
    seed: int = 0
    markov_branching: int = 4
    markov_noise: float = 0.01

    def __post_init__(self):
        valid_sources = ", ".join(repr(s.value) for s in DataSource)
        if not isinstance(self.source, DataSource):
            raise ConfigError("source", f"got {self.source!r}; valid: {valid_sources}")
        if self.source is DataSource.MARKOV and self.path:
            raise ConfigError(
                "path", "must be empty when source is 'markov' (it reads no files); "
                "use source 'text' or 'tokens' to train on files")
        if self.source is not DataSource.MARKOV and not self.path:
            raise ConfigError(
                "path", f"required when source is {self.source.value!r}: "
                + ("a file, directory or glob of text files" if self.source is DataSource.TEXT
                   else "a .npy or .bin file of token ids"))
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

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Examples for global indices int64 [n]: inputs/targets int32 [n, seq_len], mask f32."""

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
        uniforms = np.stack([np.random.default_rng([_EXAMPLE_STREAM, self.seed, int(i)])
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


class FileDataset:
    """Non-overlapping windows of ``seq_len + 1`` tokens of a 1-D token array, shuffled per epoch.

    Example ``i`` is window ``perm_e(i % num_windows)`` of epoch ``e = i // num_windows``, where
    ``perm_e`` is grain's seeded index shuffle (a different permutation every epoch).
    """

    entropy_floor = None

    def __init__(self, tokens: np.ndarray, *, seq_len: int, seed: int, label: str):
        self.tokens, self.seq_len, self.label = tokens, seq_len, label
        # A memory-mapped file that shrinks under the run would kill it with SIGBUS on the next read:
        # its identity is checked before every read instead (one stat call).
        self._watched = tokens.filename if isinstance(tokens, np.memmap) and tokens.filename else None
        self._identity = _identity(self._watched) if self._watched else None
        self.num_windows = tokens.shape[0] // (seq_len + 1)
        shuffle_seed = int(np.random.SeedSequence([_SHUFFLE_STREAM, seed]).generate_state(1)[0])
        self._order = grain.MapDataset.range(self.num_windows).shuffle(seed=shuffle_seed).repeat()

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """Window numbers int64 [n] of global example indices int64 [n]."""
        return np.array([self._order[int(i)] for i in _check_indices(indices)], np.int64)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Examples for global indices int64 [n]; see TokenDataset.rows.

        Raises:
          DataChanged: the memory-mapped token file was truncated, replaced or rewritten.
        """
        if self._watched is not None and _identity(self._watched) != self._identity:
            size, now = self._identity[0], _identity(self._watched)
            change = f"{size} -> {now[0]} bytes" if now[0] != size else "rewritten or replaced"
            raise DataChanged("data.path", f"{self._watched} changed while training ({change})")
        starts = self.windows(indices) * (self.seq_len + 1)
        return _as_rows(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)])

    def describe(self) -> str:
        return (f"data: {self.label}: {self.tokens.shape[0]:,} tokens, {self.num_windows:,} "
                f"windows of {self.seq_len + 1}; entropy floor unknown")


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


def _text_tokens(cfg: DataConfig, vocab_size: int) -> tuple[np.ndarray, str]:
    if vocab_size < 256:
        raise ConfigError("model.vocab_size", f"is {vocab_size}; source 'text' uses byte tokens "
                          "0..255, so it must be >= 256")
    files = _text_files(cfg.path)
    if len(files) == 1:
        size = os.path.getsize(files[0])
        tokens = np.memmap(files[0], np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    else:
        tokens = np.concatenate([np.fromfile(f, np.uint8) for f in files])
    return tokens, f"text bytes from {cfg.path} ({len(files)} file{'s' * (len(files) > 1)})"


def _load_npy(cfg: DataConfig) -> np.ndarray:
    try:
        tokens = np.load(cfg.path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:  # truncated, header only, random bytes, pickled
        raise ConfigError("data.path", f"{cfg.path} is not a readable .npy array of token ids "
                          f"({' '.join(str(err).split())[:160]})") from None
    if not isinstance(tokens, np.ndarray):
        raise ConfigError("data.path", f"{cfg.path} is not a single .npy array (an .npz archive?)")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ConfigError("data.path", f"{cfg.path} holds {tokens.dtype} {tokens.shape}; "
                          "expected a 1-D integer array of token ids")
    return tokens


def _load_bin(cfg: DataConfig) -> np.ndarray:
    dtype = np.dtype(cfg.token_dtype)
    size = os.path.getsize(cfg.path)
    if size % dtype.itemsize:
        raise ConfigError("data.path", f"{cfg.path} has {size} bytes, not a whole number of "
                          f"{cfg.token_dtype} tokens; is data.token_dtype right?")
    return np.memmap(cfg.path, dtype, mode="r") if size else np.zeros(0, dtype)


_ID_LOADERS: dict[str, Callable[[DataConfig], np.ndarray]] = {".npy": _load_npy, ".bin": _load_bin}


def _check_regular_file(path: str) -> None:
    """A ConfigError on ``data.path`` unless ``path`` is a regular file (or a link to one)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        what = "a broken symbolic link" if os.path.islink(path) else "no such file"
        raise ConfigError("data.path", f"{what}: {path}") from None
    except OSError as err:  # a symlink loop, a name too long, no permission
        raise ConfigError("data.path", f"cannot open {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "not a regular file")
        raise ConfigError("data.path", f"{path} is {kind}; give a .npy or .bin file of token ids")


def _id_tokens(cfg: DataConfig, vocab_size: int) -> tuple[np.ndarray, str]:
    _check_regular_file(cfg.path)
    load = _ID_LOADERS.get(os.path.splitext(cfg.path)[1])
    if load is None:
        raise ConfigError("data.path", f"{cfg.path}: expected a .npy or .bin file of token ids")
    tokens = load(cfg)
    for start in range(0, tokens.shape[0], _MAX_CHECK_CHUNK):
        chunk = tokens[start:start + _MAX_CHECK_CHUNK]
        low, high = int(chunk.min()), int(chunk.max())
        if high >= vocab_size or low < 0:
            bad = high if high >= vocab_size else low
            raise ConfigError("data.path", f"token id {bad} in {cfg.path} is outside [0, "
                              f"model.vocab_size {vocab_size}); raise model.vocab_size or fix the "
                              "tokenizer/data.token_dtype")
    return tokens, f"tokens from {cfg.path}"


def _file_dataset(read: Callable[[DataConfig, int], tuple[np.ndarray, str]]):
    def build(cfg: DataConfig, vocab_size: int, seq_len: int) -> FileDataset:
        tokens, label = read(cfg, vocab_size)
        if tokens.shape[0] < seq_len + 1:
            raise ConfigError("data.path", f"{cfg.path} has {tokens.shape[0]} tokens; need at "
                              f"least seq_len + 1 = {seq_len + 1}")
        return FileDataset(tokens, seq_len=seq_len, seed=cfg.seed, label=label)
    return build


def _markov_dataset(cfg: DataConfig, vocab_size: int, seq_len: int) -> MarkovDataset:
    if cfg.markov_branching >= vocab_size:
        raise ConfigError("data.markov_branching", f"is {cfg.markov_branching}; must be < "
                          f"model.vocab_size {vocab_size}")
    return MarkovDataset(vocab_size=vocab_size, seq_len=seq_len, seed=cfg.seed,
                         branching=cfg.markov_branching, noise=cfg.markov_noise)


_BUILDERS: dict[DataSource, Callable[[DataConfig, int, int], TokenDataset]] = {
    DataSource.MARKOV: _markov_dataset,
    DataSource.TEXT: _file_dataset(_text_tokens),
    DataSource.TOKENS: _file_dataset(_id_tokens),
}


def make_dataset(cfg: DataConfig, *, vocab_size: int, seq_len: int) -> TokenDataset:
    """The dataset ``cfg`` describes, for a model of ``vocab_size`` and sequences of ``seq_len``.

    Raises:
      ConfigError: with the full dotted field (``data.path``, ``model.vocab_size``, ...).
    """
    if vocab_size < 2:
        raise ConfigError("model.vocab_size", f"is {vocab_size}; must be >= 2")
    if seq_len < 1:
        raise ConfigError("model.seq_len", f"is {seq_len}; must be >= 1")
    return _BUILDERS[cfg.source](cfg, vocab_size, seq_len)


def global_batch(dataset: TokenDataset, step: int, batch_size: int,
                 sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
    """The global batch of ``step``: examples ``step * batch_size + r`` for r in [0, batch_size).

    Each process builds only the rows its addressable devices hold (the span from the smallest to
    the largest row it holds along dim 0) and the arrays are assembled across processes.

    Args:
      sharding: shards dim 0 (batch) over some mesh axes and replicates dim 1.

    Returns:
      ``inputs``/``targets`` int32 and ``mask`` float32, each [batch_size, seq_len] with ``sharding``.
    """
    shape = (batch_size, dataset.seq_len)
    spans = [idx[0].indices(batch_size)[:2]
             for idx in sharding.addressable_devices_indices_map(shape).values()]
    start, stop = min(s for s, _ in spans), max(s for _, s in spans)
    local = dataset.rows(step * batch_size + np.arange(start, stop, dtype=np.int64))
    return {name: jax.make_array_from_process_local_data(sharding, rows, shape)
            for name, rows in local.items()}
