"""lm-evaluation-harness on a meshtrain model: ``MeshtrainLM``, an ``lm_eval`` language model that
scores and generates with the model's parameters on its mesh, and ``evaluate_tasks``, which runs
named tasks (lm-eval's own, or YAML tasks under an include path) and gives lm-eval's results.

Requests are answered as lm-eval's transformers backend (``HFLM``) answers them, so that the same
weights score the same: text is encoded without special tokens, a context's trailing spaces move
to the continuation, an empty context is the prefix token (``bos``, else the end-of-text token),
inputs longer than ``max_length`` lose tokens on the left, rolling log-likelihoods sum disjoint
windows of ``max_length`` tokens, generation is greedy and cut at the first stop string (the
end-of-text token's text included). Each call runs a fixed shape: ``rows`` (``batch_size`` rounded
up to the data-parallel size) by a length rounded up to a power of two (at least ``MIN_LENGTH``,
at most ``max_length``), so a task compiles a few programs, not one per request:

* log-likelihoods: one forward of right-padded rows [rows, length] -> each row's summed
  continuation log-probabilities [rows] and whether greedy decoding gives the continuation [rows];
* generation: one ``lax.while_loop`` over the positions with the KV cache of [rows, length]: each
  step feeds one token per row at a position shared by all rows (a prompt's own token while the
  row is still in its prompt, else the step's argmax), so rows of any prompt length share one
  shape with no padding inside a sequence; the loop ends once every row has its tokens.

Matmuls run at full precision (``jax.default_matmul_precision("highest")``) on the parameters as
given (fp32 for a loaded model and the training state). ``lm_eval`` is imported here, and this
module only where the harness is asked for (``pip install -e '.[harness]'``).
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from meshtrain.data.tokenizer import TOKENIZER_CONFIG_FILE, end_of_document_id, load_tokenizer
from meshtrain.errors import ConfigError
from meshtrain.parallel.activations import activation_sharding
from meshtrain.parallel.rules import ShardingRules
from meshtrain.parallel.sharding import batch_sharding
from meshtrain.sampling import check_cache_fits
from models.api import CachedDecoder, forward
from models.common import ActivationSharding

MIN_LENGTH = 16  # the shortest padded length of a batch
MAX_GEN_TOKS = 256  # new tokens of a generate_until request that names none (lm-eval's HFLM default)


class TextTokenizer:
    """A ``tokenizer.json`` as lm-eval's transformers backend uses it: no special tokens added on
    encoding, special tokens skipped on decoding; ``eot_id`` ends a text, ``bos_id`` (or ``eot_id``)
    stands for an empty context.

    The ids come from the ``tokenizer_config.json`` beside the file (its ``eos_token`` and
    ``bos_token``, as transformers reads them), else from ``hf_config`` (``eos_token_id``,
    ``bos_token_id``), else the end-of-text id is the tokenizer's usual end-of-document token.
    """

    def __init__(self, path: str | pathlib.Path, hf_config: dict | None = None, *, field: str):
        self.path = pathlib.Path(path)
        self.tokenizer = load_tokenizer(self.path, field)
        recorded = _special_tokens(self.path.parent / TOKENIZER_CONFIG_FILE)
        config = hf_config or {}
        self.eot_id = self._id(recorded.get("eos_token"), config.get("eos_token_id"))
        self.bos_id = self._id(recorded.get("bos_token"), config.get("bos_token_id"))
        if self.eot_id is None:
            self.eot_id = end_of_document_id(self.tokenizer, None, field)[1]

    def _id(self, token: str | None, config_id: Any) -> int | None:
        if token is not None:
            return self.tokenizer.token_to_id(token)
        if isinstance(config_id, list):
            config_id = config_id[0] if config_id else None
        return config_id if isinstance(config_id, int) else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _special_tokens(path: pathlib.Path) -> dict[str, str]:
    """``eos_token`` / ``bos_token`` of a ``tokenizer_config.json`` (a string or ``{"content": ...}``)."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    found = {}
    for key in ("eos_token", "bos_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            found[key] = value
    return found


def bucket(length: int, cap: int) -> int:
    """``length`` rounded up to a power of two, at least ``MIN_LENGTH`` and at most ``cap``."""
    return min(cap, max(MIN_LENGTH, 1 << max(length - 1, 0).bit_length()))


class MeshtrainLM(TemplateLM):
    """An lm-eval language model on ``graphdef`` and ``params`` (on ``mesh`` under ``rules``).

    ``params`` may be replaced between evaluations (the training loop's state after each step).
    """

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh, rules: ShardingRules,
                 tokenizer: TextTokenizer, *, max_length: int, batch_size: int, field: str = "--batch-size"):
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(field, f"must be a positive integer, got {batch_size!r}")
        self.graphdef, self.params, self.mesh, self.text = graphdef, params, mesh, tokenizer
        self.shard: ActivationSharding = activation_sharding(rules, mesh)
        self.sharding = batch_sharding(rules, mesh)
        ways = rules.data_parallel_size(mesh.shape)
        self.rows = -(-batch_size // ways) * ways  # whole rows on every data-parallel group
        self._max_length, self.field = max_length, field
        self.cached = isinstance(nnx.merge(graphdef, params), CachedDecoder)
        self._checked: set[tuple[int, int]] = set()  # generation shapes whose KV cache fits

    # What TemplateLM asks of a model.
    @property
    def eot_token_id(self) -> int:
        return self.text.eot_id

    @property
    def prefix_token_id(self) -> int:
        return self.text.eot_id if self.text.bos_id is None else self.text.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.text.encode(string)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.text.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _put(self, array: np.ndarray) -> jax.Array:
        return jax.device_put(array, self.sharding)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """(summed log-probability of each continuation, whether greedy decoding gives it), for
        ``(key, context ids, continuation ids)`` requests, in their order."""
        rows = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1):]
            rows.append((whole[:-1], whole[1:], len(continuation)))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths together
        for start in range(0, len(order), self.rows):
            chunk = order[start:start + self.rows]
            length = bucket(max(len(rows[i][0]) for i in chunk), self.max_length)
            tokens, targets = np.zeros((2, self.rows, length), np.int32)
            mask = np.zeros((self.rows, length), np.float32)
            for row, index in enumerate(chunk):
                inputs, shifted, scored = rows[index]
                tokens[row, :len(inputs)], targets[row, :len(inputs)] = inputs, shifted
                mask[row, len(inputs) - scored:len(inputs)] = 1.0
            with jax.default_matmul_precision("highest"):
                logprob, greedy = _score(self.params, self._put(tokens), self._put(targets), self._put(mask),
                                         graphdef=self.graphdef, shard=self.shard)
            logprob, greedy = jax.device_get((logprob, greedy))
            for row, index in enumerate(chunk):
                results[index] = (float(logprob[row]), bool(greedy[row]))
        for request, result in zip(requests, results):
            if request[0] is not None:
                self.cache_hook.add_partial("loglikelihood", request[0], result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text: disjoint windows of ``max_length`` tokens, each after
        the token before it (the first after the prefix token), scored together and summed."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations of each context, up to its ``max_gen_toks`` tokens or the end-of-text
        token, cut at the first of its ``until`` strings."""
        if not self.cached:
            raise ConfigError("--tasks", "a generate_until task needs a model family with a KV-cache path "
                              "(init_cache / cached_forward)")
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        results = [""] * len(requests)
        eot_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], MAX_GEN_TOKS)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ConfigError("--tasks", f"a task asks for sampled generation ({requests[indices[0]].args[1]}); "
                                  "this model decodes greedily")
            until, new_tokens = handle_stop_sequences(kwargs.get("until"), eos=eot_text), kwargs["max_gen_toks"]
            if new_tokens >= self.max_length:
                raise ConfigError("--tasks", f"a task asks for {new_tokens} new tokens, not fewer than the model's "
                                  f"{self.max_length} positions")
            contexts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - new_tokens):] for i in indices}
            for index, ids in zip(indices, self._greedy(list(contexts.values()), new_tokens)):
                if self.eot_token_id in ids:
                    ids = ids[:ids.index(self.eot_token_id)]
                results[index] = postprocess_generated_text(self.tok_decode(ids), until, None)
                self.cache_hook.add_partial("generate_until", requests[index].args, results[index])
        return results

    def _greedy(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """``new_tokens`` greedy tokens after each prompt (fewer once a row has made ``eot_id``)."""
        out: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        for start in range(0, len(order), self.rows):
            chunk = order[start:start + self.rows]
            length = bucket(max(len(prompts[i]) for i in chunk) + new_tokens, self.max_length)
            if (self.rows, length) not in self._checked:
                check_cache_fits(self.graphdef, self.params, (self.rows, 1), length, self.mesh.devices.flat[0],
                                 shard=self.shard, field=self.field)
                self._checked.add((self.rows, length))
            tokens = np.zeros((self.rows, length), np.int32)
            lengths = np.ones(self.rows, np.int32)  # a padding row: one token, dropped
            for row, index in enumerate(chunk):
                tokens[row, :len(prompts[index])], lengths[row] = prompts[index], len(prompts[index])
            with jax.default_matmul_precision("highest"):
                written = _generate(self.params, self._put(tokens), lengths, jnp.int32(new_tokens),
                                    jnp.int32(self.eot_token_id), graphdef=self.graphdef, shard=self.shard)
            written = np.asarray(jax.device_get(written))
            for row, index in enumerate(chunk):
                out[index] = [int(t) for t in written[row, lengths[row]:lengths[row] + new_tokens]]
        return out


@functools.partial(jax.jit, static_argnames=("graphdef", "shard"))
def _score(params: nnx.State, tokens: jax.Array, targets: jax.Array, mask: jax.Array, *, graphdef: nnx.GraphDef,
           shard: ActivationSharding) -> tuple[jax.Array, jax.Array]:
    """tokens, targets, mask [rows, length] -> (summed log p(target) over the mask [rows], whether every
    masked target is the argmax [rows])."""
    logits = forward(nnx.merge(graphdef, params), tokens, shard).astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    greedy = (jnp.argmax(logits, axis=-1) == targets) | (mask == 0)
    return jnp.sum(target * mask, axis=-1), jnp.all(greedy, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "shard"))
def _generate(params: nnx.State, tokens: jax.Array, lengths: jax.Array, new_tokens: jax.Array, eot: jax.Array, *,
              graphdef: nnx.GraphDef, shard: ActivationSharding) -> jax.Array:
    """tokens [rows, length] holding each row's prompt of ``lengths`` [rows] tokens -> the same with up to
    ``new_tokens`` greedy tokens written after each prompt (the rest of a row is undefined)."""
    model = nnx.merge(graphdef, params)
    rows, length = tokens.shape

    def step(carry):
        t, tokens, cache, done = carry  # position t is known in every row; write position t + 1
        logits, cache = model.cached_forward(jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1), cache, t, shard)
        best = jnp.argmax(logits[:, -1].astype(jnp.float32), axis=-1).astype(jnp.int32)
        in_prompt = t + 1 < lengths
        token = jnp.where(in_prompt, jax.lax.dynamic_index_in_dim(tokens, t + 1, axis=1, keepdims=False), best)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], t + 1, axis=1)
        done = done | (~in_prompt & ((token == eot) | (t + 2 >= lengths + new_tokens)))
        return t + 1, tokens, cache, done

    def running(carry) -> jax.Array:
        t, _, _, done = carry
        return (t + 1 < length) & ~jnp.all(done)

    carry = (jnp.int32(0), tokens, model.init_cache(rows, length), jnp.zeros((rows,), bool))
    return jax.lax.while_loop(running, step, carry)[1]


def task_manager(include_path: str, *, field: str):
    """lm-eval's ``TaskManager`` over its own tasks and the YAML tasks under ``include_path`` (if any)."""
    from lm_eval.tasks import TaskManager

    if include_path and not pathlib.Path(include_path).is_dir():
        raise ConfigError(field, f"no such directory: {include_path}")
    return TaskManager(include_path=include_path or None)


def check_tasks(manager, tasks: Sequence[str], *, field: str) -> None:
    """``ConfigError(field)`` naming the tasks ``manager`` does not know."""
    if not tasks or not all(isinstance(name, str) and name for name in tasks):
        raise ConfigError(field, f"must name at least one task, got {list(tasks)!r}")
    known = set(manager.all_tasks)
    unknown = [name for name in tasks if name not in known]
    if unknown:
        raise ConfigError(field, f"unknown task(s) {unknown}: not lm-eval's nor under the include path "
                          "(a YAML file whose `task:` names it)")


def evaluate_tasks(lm: TemplateLM, tasks: Sequence[str], manager, *, limit: float | None = None,
                   log_samples: bool = False, bootstrap_iters: int = 100_000, reseed: bool = True) -> dict:
    """lm-eval's results (``simple_evaluate``) of ``lm`` on ``tasks``, at most ``limit`` documents each;
    ``reseed``: seed python's, numpy's and torch's global generators as lm-eval's command line does."""
    from lm_eval import simple_evaluate

    seeds = {} if reseed else {"random_seed": None, "numpy_random_seed": None, "torch_random_seed": None}
    return simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=manager, log_samples=log_samples,
                           bootstrap_iters=bootstrap_iters, **seeds)


def scores(results: dict) -> dict[str, float]:
    """The numbers of ``results["results"]`` as ``harness/TASK/METRIC`` (``METRIC/FILTER`` for a filter
    other than ``none``), standard errors left out: what metrics.jsonl and the trackers get."""
    flat = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            flat[f"harness/{task}/{metric}" + ("" if filter_name == "none" else f"/{filter_name}")] = float(value)
    return flat
