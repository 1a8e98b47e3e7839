"""The generated source: a random order-2 Markov chain with an exactly known entropy floor.

``MarkovDataset`` builds the chain from ``data.seed`` (O(vocab * branching) memory and set-up),
finds its stationary distribution by sparse power iteration, and samples example ``i`` from a
generator keyed by ``(seed, i)``: rows as ``TokenDataset.rows``, int32 [n, seq_len]. Its
``entropy_floor`` is the exact best achievable loss (nats/target), ``held_out()`` the same chain's
evaluation examples (another sample stream).
"""

from __future__ import annotations

import copy
import math

import numpy as np

from meshtrain.data.dataset import CHAIN_STREAM, EXAMPLE_STREAM, HELD_OUT_STREAM, as_rows, check_indices

_WEIGHT_RATIO = 3.0  # successor j of a context has weight proportional to _WEIGHT_RATIO ** -j
_STATIONARY_TOL = 1e-15  # L1 change per power-iteration step at which the chain counts as mixed
_STATIONARY_MAX_ITERS = 200_000


def _distinct_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """int64 [rows, k]: k distinct random tokens of [0, rows) per row, in O(rows * k)."""
    out = rng.integers(0, rows, (rows, k))
    while True:
        ordered = np.sort(out, 1)
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(1)
        if not repeated.any():
            return out
        out[repeated] = rng.integers(0, rows, (int(repeated.sum()), k))



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
        rng = np.random.default_rng([CHAIN_STREAM, seed])
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
        self.sample_stream = EXAMPLE_STREAM

    bytes_per_token = None
    tokenizer_file = None

    def held_out(self) -> MarkovDataset:
        """The same chain sampled from another stream: examples no training step sees."""
        held_out = copy.copy(self)
        held_out.sample_stream = HELD_OUT_STREAM
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
        indices = check_indices(indices)
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
        return as_rows(tokens)

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
