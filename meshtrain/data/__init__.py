"""Training data: the ``data`` config section, the dataset factories and the sharded global batch.

Every example is a deterministic function of ``(DataConfig.seed, example index)`` only, so any
process can build any rows without coordination, and the batch of step ``s`` is the same whatever
the mesh or the number of processes. Three sources:

* ``markov``: an embedded, generated order-2 Markov chain (no download) with an exactly known
  entropy floor, so a training run can be judged against the best achievable loss (``markov.py``).
* ``text``: local files read as bytes (byte-level tokens 0..255; ``sources.py``).
* ``tokens``: a prepared directory (``python -m meshtrain.data prepare``: token shards, document
  boundaries, its tokenizer; ``corpus.py``), or pre-tokenised ids in one ``.npy`` or raw ``.bin``
  file; ``data.mixture`` draws from several with weights (``sources.py``).

This module turns a ``DataConfig`` into a dataset (``make_dataset``, ``make_held_out_dataset``: a
``dataset.TokenDataset``) and a step into its global batch (``global_batch``); ``data.packing``
(how windows relate to documents) is described in ``sources.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
from collections.abc import Callable

import jax
import numpy as np

from meshtrain.data.prepared import is_prepared_dir
from meshtrain.data.dataset import TokenDataset
from meshtrain.data.markov import MarkovDataset
from meshtrain.data.sources import (TOKEN_DTYPES, TRAIN_SPLIT, FileDataset, MixtureDataset, StreamInfo,
                                    TokenStream, file_dataset, given_tokenizer, id_stream, text_stream)
from meshtrain.errors import ConfigError
from models.common import coerce_enums


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
        coerce_enums(self, ConfigError)
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
            total = sum(float(entry.weight) for entry in self.mixture)
            if not math.isfinite(total):
                raise ConfigError("mixture", f"the weights sum to {total} (too large for a float); scale them down "
                                  "(only their ratios matter)")
            for i, entry in enumerate(self.mixture):
                if not entry.weight / total >= sys.float_info.min:  # a share that underflows to 0 or a denormal
                    raise ConfigError(f"mixture[{i}].weight", f"{entry.weight!r} is too small next to the others' "
                                      f"sum {total:g} (its share {entry.weight / total:g} underflows); scale the "
                                      "weights so that every share is above 1e-300")
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
        if self.token_dtype not in TOKEN_DTYPES:
            raise ConfigError("token_dtype", f"got {self.token_dtype!r}; valid: "
                              + ", ".join(TOKEN_DTYPES))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ConfigError("seed", f"got {self.seed!r}; must be an integer in [0, 2**32)")
        if (isinstance(self.markov_branching, bool) or not isinstance(self.markov_branching, int)
                or self.markov_branching < 1):
            raise ConfigError("markov_branching", f"got {self.markov_branching!r}; "
                              "must be an integer >= 1 (and < model.vocab_size)")
        if not isinstance(self.markov_noise, (int, float)) or not 0.0 < self.markov_noise < 1.0:
            raise ConfigError("markov_noise", f"got {self.markov_noise!r}; must be a number in "
                              "(0, 1) (0 would allow a non-unique stationary distribution)")



def _id_stream(cfg: DataConfig, path: str, field: str, vocab_size: int, given: tuple[str, str] | None,
               split: str = TRAIN_SPLIT) -> tuple[TokenStream, StreamInfo]:
    """``sources.id_stream`` with ``cfg``'s packing and token dtype."""
    return id_stream(path, field, vocab_size, given, documents=cfg.packing is Packing.DOCUMENTS,
                     token_dtype=cfg.token_dtype, split=split)


def _markov_dataset(cfg: DataConfig, vocab_size: int, seq_len: int) -> MarkovDataset:
    if cfg.markov_branching >= vocab_size:
        raise ConfigError("data.markov_branching", f"is {cfg.markov_branching}; must be < "
                          f"model.vocab_size {vocab_size}")
    return MarkovDataset(vocab_size=vocab_size, seq_len=seq_len, seed=cfg.seed,
                         branching=cfg.markov_branching, noise=cfg.markov_noise)


def _text_dataset(cfg: DataConfig, vocab_size: int, seq_len: int) -> FileDataset:
    stream, info = text_stream(cfg.path, "data.path", vocab_size)
    return file_dataset(stream, info, cfg.path, "data.path", seq_len=seq_len, seed=cfg.seed)


def _tokens_dataset(cfg: DataConfig, vocab_size: int, seq_len: int) -> TokenDataset:
    given = given_tokenizer(cfg.tokenizer, vocab_size)
    if not cfg.mixture:
        stream, info = _id_stream(cfg, cfg.path, "data.path", vocab_size, given)
        return file_dataset(stream, info, cfg.path, "data.path", seq_len=seq_len, seed=cfg.seed)
    datasets, hashes = [], []
    for i, entry in enumerate(cfg.mixture):
        field = f"data.mixture[{i}].path"
        stream, info = _id_stream(cfg, entry.path, field, vocab_size, given)
        if hashes and info.tokenizer_sha256 != hashes[0]:
            raise ConfigError(field, f"{entry.path} was tokenized with another tokenizer than "
                              f"{cfg.mixture[0].path}; a mixture needs one tokenizer")
        hashes.append(info.tokenizer_sha256)
        seed = int(np.random.SeedSequence([cfg.seed, i]).generate_state(1)[0])  # each its own order
        datasets.append(file_dataset(stream, info, entry.path, field, seq_len=seq_len, seed=seed))
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
        stream, info = text_stream(path, field, vocab_size)
    else:
        stream, info = _id_stream(cfg, path, field, vocab_size, given_tokenizer(cfg.tokenizer, vocab_size), split)
    return file_dataset(stream, info, path, field, seq_len=seq_len, seed=cfg.seed, shuffle=False)


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
