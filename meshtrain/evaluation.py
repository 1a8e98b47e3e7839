"""Held-out evaluation during training: the ``eval`` section and the ``Evaluator``.

Every ``eval.every`` steps and after the last step, the model's mean token cross-entropy over the
first ``eval.batches`` global batches (``train.batch_size`` rows each) of held-out windows, in
order. ``Trainer.eval_step`` is one jitted forward with the training shardings (compiled once, on
any mesh, through the pipeline schedule's forward when ``mesh.stage`` > 1). Reported:

* ``eval_loss``: sum of the targets' cross-entropy / number of targets (nats per token);
* ``eval_perplexity``: ``exp(eval_loss)``;
* ``eval_bits_per_byte``: ``eval_loss / ln 2 / bytes_per_token``, where the held-out data knows its
  UTF-8 text bytes per token (a prepared split: text bytes / tokens, its end-of-document tokens
  included; byte-level text: 1).

With ``eval.sample_prompts``, each evaluation also continues every prompt with the model
(``meshtrain.generate``'s KV-cache path on the training mesh and parameters; greedy at
``sample_temperature`` 0) for up to ``sample_tokens`` tokens, encoded and decoded by the run's
tokenizer: bytes for ``data.source: text``, the prepared corpus's (or ``data.tokenizer``'s)
``tokenizer.json`` for ``tokens``; the markov source has none.

With ``eval.harness.tasks``, lm-evaluation-harness tasks are scored on the training state too
(``meshtrain.harness``, on the training mesh), at every evaluation or every ``eval.harness.every``
steps and after the last: each number of lm-eval's results as ``harness/TASK/METRIC``.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import numpy as np
from flax import nnx

from meshtrain.data import DataConfig, DataSource, Packing, global_batch, make_held_out_dataset
from meshtrain.data.dataset import TokenDataset
from meshtrain.data.sources import FileDataset
from meshtrain.errors import ConfigError
from meshtrain.parallel.activations import activation_sharding
from meshtrain.sampling import ByteTokenizer, HFTokenizer, check_cache_fits, generate_tokens
from models.api import CachedDecoder


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    """The ``eval.harness`` entry: lm-evaluation-harness tasks scored during training.

    Attributes:
      tasks: lm-eval task names (its own, or YAML tasks under ``include_path``); empty: none.
      include_path: a directory of lm-eval YAML tasks added to lm-eval's own.
      every: score every this many steps and after the last one; 0: at every evaluation (``eval.every``).
      limit: at most this many documents per task; 0: all.
      batch_size: rows per forward (rounded up to the data-parallel size).
    """

    tasks: tuple[str, ...] = ()
    include_path: str = ""
    every: int = 0
    limit: int = 0
    batch_size: int = 8

    def __post_init__(self):
        if isinstance(self.tasks, str) or not all(isinstance(t, str) and t.strip() for t in self.tasks):
            raise ConfigError("harness.tasks", f"must be a list of lm-eval task names, got {self.tasks!r}")
        object.__setattr__(self, "tasks", tuple(self.tasks))
        for name, least in (("every", 0), ("limit", 0), ("batch_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"harness.{name}", f"got {value!r}; must be an integer >= {least}")

    def due(self, done: int, steps: int, eval_every: int) -> bool:
        """Whether to score the tasks after step ``done`` of ``steps``."""
        every = self.every or eval_every
        return bool(self.tasks) and every > 0 and (done % every == 0 or done == steps)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The ``eval`` section.

    Attributes:
      every: evaluate every this many steps and after the last one; 0 = never.
      batches: global batches (of ``train.batch_size`` rows) per evaluation; fewer when the
        held-out data has fewer windows.
      path: where the held-out windows come from: empty = held out from the training data (the
        ``split`` of ``data.path``'s prepared directory; the markov source's other sample
        stream); else a prepared directory (its ``split``), or files read like ``data.path``.
      split: the prepared directory's split to evaluate on.
      harness: lm-evaluation-harness tasks scored during training (``HarnessConfig``).
    """

    every: int = 0
    batches: int = 4
    path: str = ""
    split: str = "val"
    sample_prompts: tuple[str, ...] = ()
    sample_tokens: int = 32
    sample_temperature: float = 0.0
    harness: HarnessConfig = dataclasses.field(default_factory=HarnessConfig)

    def __post_init__(self):
        for name in ("every", "batches", "sample_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "every" else 1):
                raise ConfigError(name, f"got {value!r}; must be an integer >= {0 if name == 'every' else 1}")
        if not self.split:
            raise ConfigError("split", "must name a split of a prepared directory (train or val)")
        if isinstance(self.sample_prompts, str) or not all(isinstance(p, str) and p for p in self.sample_prompts):
            raise ConfigError("sample_prompts", f"must be a list of non-empty strings, got {self.sample_prompts!r}")
        object.__setattr__(self, "sample_prompts", tuple(self.sample_prompts))
        if self.sample_prompts and self.every == 0:
            raise ConfigError("sample_prompts", "are decoded at each evaluation: set eval.every > 0")
        if not (isinstance(self.sample_temperature, (int, float)) and math.isfinite(self.sample_temperature)
                and self.sample_temperature >= 0):
            raise ConfigError("sample_temperature", f"must be a finite number >= 0 (0: greedy), got "
                              f"{self.sample_temperature!r}")
        if self.harness.tasks and self.every == 0:
            raise ConfigError("harness", "runs with the evaluations: set eval.every > 0")

    def due(self, done: int, steps: int) -> bool:
        """Whether to evaluate after step ``done`` of ``steps``."""
        return self.every > 0 and (done % self.every == 0 or done == steps)


class Evaluator:
    """The held-out batches of a run and the compiled forward that scores them."""

    def __init__(self, cfg: EvalConfig, data_cfg: DataConfig, train_data: TokenDataset, trainer, *,
                 vocab_size: int, seq_len: int):
        self.dataset = make_held_out_dataset(data_cfg, train_data, path=cfg.path, split=cfg.split,
                                             field="eval.path", vocab_size=vocab_size, seq_len=seq_len)
        self.batch_size, self.batches, self.every = trainer.layout.train.batch_size, cfg.batches, cfg.every
        if isinstance(self.dataset, FileDataset):
            self.batches = min(cfg.batches, self.dataset.num_windows // self.batch_size)
            if self.batches == 0:
                raise ConfigError("eval.batches", f"the held-out data has {self.dataset.num_windows} windows of "
                                  f"{seq_len + 1} tokens, fewer than one batch of train.batch_size "
                                  f"{self.batch_size}; hold out more (prepare --val-fraction) or lower "
                                  "train.batch_size")
        self.sharding = trainer.batch_sharding
        self.model_params = trainer.model_params  # a state's parameters as one tree (train.lora: merged)
        documents = data_cfg.packing is Packing.DOCUMENTS
        self.step = trainer.eval_step.lower(trainer.abstract_state().params,
                                            trainer.abstract_batch(documents)).compile()
        self.sampler = Sampler(cfg, data_cfg, train_data, trainer, vocab_size) if cfg.sample_prompts else None
        self.harness = Harness(cfg, train_data, trainer, seq_len) if cfg.harness.tasks else None

    def describe(self) -> str:
        source = (self.dataset.info.label if isinstance(self.dataset, FileDataset)
                  else "the markov chain's held-out sample stream")
        harness = (f"; lm-eval tasks {', '.join(self.harness.cfg.tasks)} every {self.harness.cfg.every or self.every} "
                   "steps and after the last" if self.harness is not None else "")
        return (f"eval: every {self.every} steps and after the last, {self.batches} batches of "
                f"{self.batch_size} windows from {source}{harness}")

    def run(self, params) -> dict[str, float]:
        """The held-out metrics of ``params`` (see the module docstring)."""
        loss_sum, targets = 0.0, 0.0
        for index in range(self.batches):
            batch = global_batch(self.dataset, index, self.batch_size, self.sharding)
            out = jax.device_get(self.step(params, batch))
            loss_sum += float(out["loss_sum"])
            targets += float(out["target_tokens"])
        loss = loss_sum / max(targets, 1.0)
        per_byte = self.dataset.bytes_per_token
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
                "eval_bits_per_byte": None if not per_byte else loss / math.log(2) / per_byte,
                "eval_tokens": targets}


class Sampler:
    """``eval.sample_prompts`` continued by the model at each evaluation (module docstring)."""

    def __init__(self, cfg: EvalConfig, data_cfg: DataConfig, train_data: TokenDataset, trainer, vocab_size: int):
        if not isinstance(nnx.merge(trainer.graphdef, trainer.abstract_params), CachedDecoder):
            raise ConfigError("eval.sample_prompts", f"model family {trainer.family.name!r} has no KV-cache path "
                              "(init_cache / cached_forward), which sampling needs")
        if data_cfg.source is DataSource.TEXT:
            self.tokenizer = ByteTokenizer()
        elif train_data.tokenizer_file is not None:
            self.tokenizer = HFTokenizer(pathlib.Path(train_data.tokenizer_file))
        else:
            raise ConfigError("eval.sample_prompts", f"the run's data (data.source={data_cfg.source.value}) has no "
                              "tokenizer to encode the prompts and decode the samples; use data.source=text, a "
                              "prepared corpus, or data.tokenizer")
        self.prompts = []
        for prompt in cfg.sample_prompts:
            ids = self.tokenizer.encode(prompt)
            if not ids or max(ids) >= vocab_size:
                raise ConfigError("eval.sample_prompts", f"{prompt!r} encodes to {ids[:8]}, not ids in "
                                  f"[0, {vocab_size}) (a non-empty prompt the model's vocabulary holds)")
            self.prompts.append((prompt, ids))
        self.tokens, self.temperature = cfg.sample_tokens, cfg.sample_temperature
        self.graphdef, self.shard = trainer.graphdef, activation_sharding(trainer.rules, trainer.mesh)
        self.rows = trainer.rules.data_parallel_size(trainer.mesh.shape)  # the batch splits that many ways
        longest = max(len(ids) for _, ids in self.prompts)  # at start-up, not at the first evaluation
        check_cache_fits(self.graphdef, trainer.abstract_params, (self.rows, longest), longest + self.tokens,
                         trainer.mesh.devices.flat[0], shard=self.shard, field="eval.sample_tokens")

    def run(self, params, seed: int) -> list[dict[str, str]]:
        """[{"prompt": p, "text": its continuation}] for each prompt, with the model on ``params``."""
        samples = []
        for index, (prompt, ids) in enumerate(self.prompts):
            new = list(generate_tokens(self.graphdef, params, np.asarray([ids] * self.rows), self.tokens,
                                       temperature=self.temperature, seed=seed + index,
                                       stop_id=self.tokenizer.eos_id, shard=self.shard)[0])
            if self.tokenizer.eos_id is not None and self.tokenizer.eos_id in new:
                new = new[:new.index(self.tokenizer.eos_id)]
            samples.append({"prompt": prompt, "text": self.tokenizer.decode(new)})
        return samples


class Harness:
    """``eval.harness``: lm-eval's tasks scored on the training state (``meshtrain.harness`` on the
    training mesh, the run's tokenizer), checked at start-up."""

    def __init__(self, cfg: EvalConfig, train_data: TokenDataset, trainer, seq_len: int):
        self.cfg, self.eval_every = cfg.harness, cfg.every
        if trainer.mesh.shape["stage"] != 1:
            raise ConfigError("eval.harness", "scores the model outside a pipeline schedule: use mesh.stage 1")
        if train_data.tokenizer_file is None:
            raise ConfigError("eval.harness", "the tasks are text: the run's data needs a tokenizer.json (a prepared "
                              "corpus, or data.tokenizer)")
        try:
            from meshtrain import harness
        except ImportError as err:
            raise ConfigError("eval.harness", f"lm-evaluation-harness is not installed ({err.msg}): pip install -e "
                              "'.[harness]'") from None
        self.module = harness
        self.manager = harness.task_manager(self.cfg.include_path, field="eval.harness.include_path")
        harness.check_tasks(self.manager, self.cfg.tasks, field="eval.harness.tasks")
        tokenizer = harness.TextTokenizer(train_data.tokenizer_file, field="data.tokenizer")
        self.lm = harness.MeshtrainLM(trainer.graphdef, trainer.abstract_params, trainer.mesh, trainer.rules,
                                      tokenizer, max_length=seq_len, batch_size=self.cfg.batch_size,
                                      field="eval.harness.batch_size")

    def due(self, done: int, steps: int) -> bool:
        return self.cfg.due(done, steps, self.eval_every)

    def run(self, params) -> dict[str, float]:
        """``harness/TASK/METRIC`` scores of the model on ``params`` (python's, numpy's and torch's global
        random states left alone)."""
        self.lm.params = params
        results = self.module.evaluate_tasks(self.lm, self.cfg.tasks, self.manager, limit=self.cfg.limit or None,
                                             bootstrap_iters=0, reseed=False)
        return self.module.scores(results)
