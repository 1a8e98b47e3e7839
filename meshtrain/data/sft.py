"""Supervised fine-tuning data: ``python -m meshtrain.data prepare-sft`` turns JSON lines of
prompt/response pairs or chat messages into a prepared directory whose tokens carry a loss mask.

Each line of an input file is one example, either ::

    {"prompt": "...", "response": "..."}                      (optionally "system": "...")
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}

A pair is the conversation ``[system,] user, assistant``. The conversation is rendered with the
tokenizer's chat template (Jinja, as ``transformers``' ``apply_chat_template`` renders it: the
messages, ``add_generation_prompt`` and the tokenizer's special tokens ``bos_token``,
``eos_token``, ... as variables) and tokenized with the template's special tokens read as tokens
(``add_special_tokens=False``: the template writes BOS where the model wants one). The loss mask is
1 on the tokens of the assistant text, found in one of two ways:

* a template that marks it with ``{% generation %}...{% endgeneration %}`` (as transformers'
  ``return_assistant_tokens_mask`` requires; the built-in one does) is rendered once, and the mask
  is 1 on the text of those blocks;
* for any other template, for assistant message k: from the end of the conversation before it
  rendered with the generation prompt to the end of the conversation up to and including it (its
  content and whatever the template closes the turn with, e.g. ``<|im_end|>`` or EOS). Both texts
  must begin the whole conversation's text. They are derived from two more renderings of the whole
  conversation where that is exact, else rendered (``chat_turns.py``: time linear in the turns for
  templates that loop over the messages; an example whose other prefixes would render more than
  ``chat_turns.PREFIX_RENDER_CHARACTERS`` characters is refused: mark the template's assistant
  text instead).

Every such place must fall between two tokens of the whole conversation; an example where it does
not (the template or the tokenizer joins the prompt's end and the response's start into one token)
is refused, naming its file and line.

The template is, in order: ``--chat-template FILE``; the tokenizer directory's
``chat_template.jinja``; its ``tokenizer_config.json``'s ``chat_template``; else the built-in
``DEFAULT_CHAT_TEMPLATE`` (Alpaca-style headers, EOS after each response; for tokenizers without a
template of their own, such as ``train-tokenizer``'s). ``strftime_now`` is left undefined, so the
same input prepares the same bytes (templates that show a date fall back to their fixed one). A
special token of ``tokenizer_config.json`` that the template uses must be one token of the
tokenizer (else the template would write its name as text). The template runs in Jinja's sandbox,
without ``include``/``extends``/``import`` (it is one file) or ``lipsum``, and each rendering is
bounded (``_BoundedSandbox``): whatever it fails with is one line naming the template and the example.

Every example is checked (read, rendered, tokenized, its mask's ends checked) before ``--out`` is
touched, so bad input changes nothing already written; then the examples are written as the
documents of a prepared directory (``corpus.py``), each followed by the end-of-document token unless
its tokens already end with it (mask 0 on that token), with ``.mask.bin`` shards beside the token
shards and the template as ``chat_template.jinja``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import re
import time
import types
from collections.abc import Iterator, Sequence

import numpy as np
from rich.console import Console
from tokenizers import Tokenizer

from meshtrain import jsonio
from meshtrain.data.corpus import (BATCH_TEXT_BYTES, DEFAULT_SHARD_TOKENS, _Progress, _SplitWriter, _val_selector,
                                   finish, split_input_files, token_dtype)
from meshtrain.data.out_dir import check_out, claimed
from meshtrain.data.prepared import TRAIN, VAL, PreparedCorpus
from meshtrain.data.chat_template import CHAT_TEMPLATE_FILE, DEFAULT_CHAT_TEMPLATE, ChatTemplate
from meshtrain.data.chat_turns import ASSISTANT, Span, turn_spans
from meshtrain.data.columnar import is_columnar
from meshtrain.data.files import write_file
from meshtrain.data.tokenizer import TOKENIZER_CONFIG_FILE, end_of_document_id, load_tokenizer, tokenizer_file
from meshtrain.errors import ConfigError, cut, writable_directory
from meshtrain.run_lock import RunLock

DEFAULT_TEMPLATE_SOURCE = "the built-in default"
# The special tokens transformers passes to a template (its special_tokens_map), as strings.
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
KEEP_TOKENS = 1 << 26  # tokens the checking pass keeps for the writing one (<= 320 MB as uint32 + mask)
VALID_LINES = ('each line is {"prompt": "...", "response": "..."} (and optionally "system": "...") or '
               '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}')
# One rendering of an example may take RENDER_STEPS steps plus RENDER_STEPS_PER_BYTE per byte of its
# input line (a step: a loop iteration, a call or filter, or a character of what one makes). Ample
# for a template that does a few things per message; a loop or recursion without end stops there.
RENDER_STEPS = 1 << 20
RENDER_STEPS_PER_BYTE = 64


def _token_string(value) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken's ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_template(path: pathlib.Path, field: str) -> str:
    """The text of a template file; a one-line ``ConfigError(field)`` when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(field, f"{path} is not UTF-8 text (byte {err.start}); save the chat template as "
                          "UTF-8") from None


def _check_special_tokens(template: ChatTemplate, tokenizer: Tokenizer, config_path: pathlib.Path,
                          configured: set[str]) -> None:
    """Refuses a special token of tokenizer_config.json that the template writes but that is not one
    token of the tokenizer: it would be written as text (an eos_token's characters trained on, the
    real end never)."""
    for name in sorted(template.uses & configured):
        token = template.variables[name]
        count = len(tokenizer.encode(token, add_special_tokens=False).ids)
        if token and count != 1:
            specials = sorted(added.content for added in tokenizer.get_added_tokens_decoder().values() if added.special)
            valid = f"one of its special tokens ({cut(', '.join(specials), 160)})" if specials else "one of its tokens"
            effect = (": the mask would train on its characters and the model never learn to stop"
                      if name == "eos_token" else "")
            raise ConfigError("--tokenizer", f"{config_path}: {name} {token!r} is not a token of the tokenizer, so "
                              f"the chat template would write it as text ({count} tokens){effect}; set it to "
                              f"{valid}, or remove it")


def rendered_text_tokenizer(tokenizer_path: str) -> Tokenizer:
    """The tokenizer at ``tokenizer_path`` as ``prepare-sft`` tokenizes a rendered conversation: the
    template's special tokens are tokens, nothing added, truncated or padded."""
    tokenizer = load_tokenizer(tokenizer_path, "--tokenizer")
    tokenizer.encode_special_tokens = False
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.post_processor = None  # adds nothing without special tokens, but would trim the tokens' characters
    return tokenizer


def chat_prompt(tokenizer_path: str, messages: list[dict], template_path: str | None = None
                ) -> tuple[list[int], int]:
    """The token ids of ``messages`` rendered by the chat template ``prepare-sft`` uses with this
    tokenizer (``load_chat_template``) followed by the assistant's header (``add_generation_prompt``),
    which a model fine-tuned on such data continues; and the id that ends its reply: the template's
    ``eos_token`` (tokenizer_config.json's, else the end-of-document token prepare-sft appends)."""
    tokenizer = rendered_text_tokenizer(tokenizer_path)
    eos_token, eos_id = end_of_document_id(tokenizer, None, "--tokenizer")
    template = load_chat_template(tokenizer_path, tokenizer, eos_token, template_path)
    budget = RENDER_STEPS + RENDER_STEPS_PER_BYTE * sum(len(m["content"].encode("utf-8")) for m in messages)
    text = "".join(template.stream(messages, True, budget, "--prompt", "--prompt"))
    reply_end = tokenizer.token_to_id(template.variables["eos_token"])
    return tokenizer.encode(text).ids, eos_id if reply_end is None else reply_end


def load_chat_template(tokenizer_path: str, tokenizer: Tokenizer, eos_token: str,
                       template_path: str | None = None) -> ChatTemplate:
    """The chat template ``prepare-sft`` renders with (see the module docstring), with the special
    tokens of the tokenizer directory's ``tokenizer_config.json`` (``eos_token`` defaulting to the
    end-of-document token ``eos_token``). One-line ``ConfigError`` for a template that cannot be
    read or loads other files, and for a special token of tokenizer_config.json that the template
    uses but ``tokenizer`` does not hold as one token."""
    directory = tokenizer_file(tokenizer_path).parent
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = {}
    if config_path.is_file():
        try:
            config = jsonio.loads(config_path.read_text(encoding="utf-8"), max_depth=None)
        except (ValueError, UnicodeDecodeError) as err:
            raise ConfigError("--tokenizer", f"{config_path} is not JSON ({err})") from None
        if not isinstance(config, dict):
            raise ConfigError("--tokenizer", f"{config_path} holds a {type(config).__name__}, not a JSON object")
    variables = {name: token for name in TEMPLATE_TOKENS if (token := _token_string(config.get(name))) is not None}
    configured = set(variables)
    variables.setdefault("eos_token", eos_token)
    template = _find_template(directory, config_path, config, variables, template_path)
    _check_special_tokens(template, tokenizer, config_path, configured)
    return template


def _find_template(directory: pathlib.Path, config_path: pathlib.Path, config: dict, variables: dict[str, str],
                   template_path: str | None) -> ChatTemplate:
    """The first template of: ``template_path``, the directory's chat_template.jinja, the config's
    chat_template, the built-in one; compiled."""
    if template_path is not None:
        path = pathlib.Path(template_path)
        if not path.is_file():
            raise ConfigError("--chat-template", f"no such file: {template_path}; give a Jinja chat template file")
        return ChatTemplate.compile(_read_template(path, "--chat-template"), str(path), variables, "--chat-template")
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        path = directory / CHAT_TEMPLATE_FILE
        return ChatTemplate.compile(_read_template(path, "--tokenizer"), str(path), variables, "--tokenizer")
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the one named "default"
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        if "default" not in named:
            raise ConfigError("--tokenizer", f"{config_path} names chat templates {', '.join(map(str, named))} but "
                              "none 'default'; give one with --chat-template FILE")
        template = named["default"]
    if template is None:
        return ChatTemplate.compile(DEFAULT_CHAT_TEMPLATE, DEFAULT_TEMPLATE_SOURCE, variables, "--chat-template")
    if not isinstance(template, str):
        raise ConfigError("--tokenizer", f"{config_path}: chat_template is a {type(template).__name__}, not text")
    return ChatTemplate.compile(template, f"{config_path}", variables, "--tokenizer")


# ---- reading the examples ----

_JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "text", list: "a list", dict: "an object",
               type(None): "null"}


def _kind(value) -> str:
    """What a parsed JSON value is, in words ("a number", "an object", ...)."""
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _message(value, number: int, where: str, field: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(field, f"{where}: messages[{number}] is {_kind(value)}, not "
                          f"{{\"role\": ..., \"content\": ...}}; {VALID_LINES}")
    for key in ("role", "content"):
        if not isinstance(value.get(key), str):
            found = "missing" if key not in value else _kind(value[key])
            raise ConfigError(field, f"{where}: messages[{number}].{key} is {found}, not text; {VALID_LINES}")
    return value


def conversation(record, where: str, field: str = "--input") -> list[dict]:
    """The messages of one parsed line (``where``: its file:line, from the flag ``field``); a one-line
    ``ConfigError`` naming it and the valid forms when it is neither."""
    if not isinstance(record, dict):
        raise ConfigError(field, f"{where} is {_kind(record)}, not a JSON object; {VALID_LINES}")
    if "messages" in record:
        if "prompt" in record or "response" in record:
            raise ConfigError(field, f"{where} has both \"messages\" and \"prompt\"/\"response\"; give one "
                              "form per line")
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(field, f"{where}: \"messages\" is not a non-empty list; {VALID_LINES}")
        messages = [_message(value, number, where, field) for number, value in enumerate(messages)]
    elif "prompt" in record and "response" in record:
        pair = {key: record[key] for key in ("system", "prompt", "response") if key in record}
        for key, value in pair.items():
            if not isinstance(value, str):
                raise ConfigError(field, f"{where}: \"{key}\" is {_kind(value)}, not text; "
                                  f"{VALID_LINES}")
        messages = ([{"role": "system", "content": pair["system"]}] if "system" in pair else []) + [
            {"role": "user", "content": pair["prompt"]}, {"role": ASSISTANT, "content": pair["response"]}]
    else:
        keys = ", ".join(record) or "none"
        raise ConfigError(field, f"{where} has neither \"messages\" nor \"prompt\" and \"response\" (its keys: "
                          f"{keys}); {VALID_LINES}")
    if not any(message["role"] == ASSISTANT for message in messages):
        raise ConfigError(field, f"{where} has no message with role \"{ASSISTANT}\", so nothing to train on; "
                          f"{VALID_LINES}")
    return messages


@dataclasses.dataclass
class _Example:
    """One conversation rendered: its text and the spans of it to train on."""

    where: str
    field: str  # the flag its file came from (--input, --val-input)
    split: str
    text: str
    size: int  # UTF-8 bytes of text
    turns: int  # its assistant messages
    spans: list[Span]


class _Reader:
    """The examples of ``files`` in order, rendered; counters as ``corpus.DocumentReader``'s."""

    def __init__(self, files: Sequence[pathlib.Path], field: str, template: ChatTemplate, special: re.Pattern | None):
        self.files, self.field, self.template, self.special = list(files), field, template, special
        self.bytes_read = self.files_read = 0

    def __iter__(self) -> Iterator[_Example]:
        examples = 0
        for path in self.files:
            with open(path, "rb") as stream:
                for number, line in enumerate(stream, 1):
                    self.bytes_read += len(line)
                    if line.strip():
                        examples += 1
                        yield self._example(line, f"{path}:{number}")
            self.files_read += 1
        if not examples:
            raise ConfigError(self.field, f"no examples in {self.field} ({len(self.files)} files, all empty); "
                              f"{VALID_LINES}")

    def _example(self, line: bytes, where: str) -> _Example:
        try:
            record = jsonio.loads(line, max_depth=None)
        except ValueError as err:
            raise ConfigError(self.field, f"{where} is not a line of JSON ({err}); {VALID_LINES}") from None
        messages = conversation(record, where, self.field)
        if self.special is not None:
            for number, message in enumerate(messages):
                found = self.special.search(message["content"])
                if found:
                    raise ConfigError(self.field, f"{where}: messages[{number}].content holds {found.group()!r}, a "
                                      "special token of the tokenizer, written as text; it would be read as the "
                                      "token (a forged turn or document end): remove it from the data")
        budget = RENDER_STEPS + RENDER_STEPS_PER_BYTE * len(line)
        text, generated = self.template.render(messages, budget, where, self.field)
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise ConfigError(self.field, f"{where} holds a lone surrogate (\\ud800-\\udfff escape), which is not "
                              "text") from None
        turns = sum(message["role"] == ASSISTANT for message in messages)
        if self.template.marks_generation:
            if not generated:
                raise ConfigError(self.field, f"{where}: the chat template ({self.template.source}) marks none of "
                                  "its text with {% generation %}, so nothing is trained on; mark each assistant "
                                  "message's text with {% generation %}...{% endgeneration %}")
            spans = [Span(f"{{% generation %}} block {number}", start, end, "the conversation before it",
                          "the conversation up to its end") for number, (start, end) in enumerate(generated, 1)]
        else:
            spans = turn_spans(self.template, messages, text, budget, where, self.field)
        return _Example(where, self.field, "", text, size, turns, spans)


def _special_tokens(tokenizer: Tokenizer) -> re.Pattern | None:
    """A pattern matching any of the tokenizer's special tokens written as text."""
    tokens = sorted({token.content for token in tokenizer.get_added_tokens_decoder().values()
                     if token.special and token.content}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def _describe_divergence(tokenizer: Tokenizer, part: np.ndarray, whole: np.ndarray) -> str:
    at = int(np.argmax(part[:len(whole)] != whole[:len(part)])) if len(part) <= len(whole) else len(whole)
    if len(part) > len(whole) or part[at] == whole[at]:
        return f"it has {len(part)} tokens, the whole {len(whole)}"
    show = lambda token_id: repr(tokenizer.id_to_token(int(token_id)))
    return f"token {at} is {show(part[at])} there but {show(whole[at])} in the whole conversation"


def _tokens_before(tokenizer: Tokenizer, example: _Example, span: Span, at: int, what: str, ids: np.ndarray,
                   offsets: np.ndarray) -> int:
    """How many of the whole conversation's tokens its first ``at`` characters are (``offsets``:
    [tokens, 2] their characters); a one-line ``ConfigError`` when a token spans character ``at``."""
    count = int(np.searchsorted(offsets[:, 1], at, side="right"))
    if count == len(ids) or offsets[count, 0] >= at:
        return count
    part = np.array(tokenizer.encode(example.text[:at], add_special_tokens=False).ids, np.int64)
    raise ConfigError(example.field, f"{example.where}: {span.label}: the tokens of {what} are not a prefix of the "
                      f"whole conversation's ({_describe_divergence(tokenizer, part, ids)}): the tokenizer joins the "
                      "prompt's end and the response's start into one token (a generation prompt ending in a space, or "
                      "a response starting with whitespace?); change the example or the template")


def _tokenized(tokenizer: Tokenizer, examples: list[_Example], eos_id: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each example's ids (ending in ``eos_id``) and loss mask (uint8), both [tokens]: 1 on the tokens
    of its spans, found by the characters of the whole text's tokens (the tokenizer's post-processor
    is off, so they are not trimmed); a one-line ``ConfigError`` naming the example when a span's
    end falls inside a token or it holds none."""
    out = []
    for example, encoding in zip(examples, tokenizer.encode_batch([e.text for e in examples],
                                                                  add_special_tokens=False)):
        ids = np.array(encoding.ids, np.int64)
        offsets = np.array(encoding.offsets, np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), np.uint8)
        for span in example.spans:
            start = _tokens_before(tokenizer, example, span, span.start, span.before, ids, offsets)
            end = _tokens_before(tokenizer, example, span, span.end, span.upto, ids, offsets)
            if end <= start:
                raise ConfigError(example.field, f"{example.where}: {span.label} renders to no tokens after its "
                                  "prompt; the chat template does not show assistant messages")
            mask[start:end] = 1
        if not len(ids) or ids[-1] != eos_id:
            ids, mask = np.append(ids, eos_id), np.append(mask, np.uint8(0))
        out.append((ids, mask))
    return out


@dataclasses.dataclass(frozen=True)
class SplitCounts:
    """What ``prepare-sft`` wrote to one split."""

    examples: int
    assistant_turns: int
    tokens: int
    loss_tokens: int


@dataclasses.dataclass(frozen=True)
class SftReport:
    """What ``prepare_sft`` wrote, its template's source and the seconds it took (both passes)."""

    corpus: PreparedCorpus
    counts: dict[str, SplitCounts]
    template_source: str
    seconds: float


def _batches(readers: list[tuple[_Reader, str | None]], is_val, batch_bytes: int) -> Iterator[list[_Example]]:
    """The examples of every reader, each with its split, in batches of about ``batch_bytes`` of text."""
    number = 0
    for reader, split in readers:
        batch, size = [], 0
        for example in reader:
            example.split = split or (VAL if is_val(number) else TRAIN)
            number += 1
            batch.append(example)
            size += example.size
            if size >= batch_bytes:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


def prepare_sft(inputs: Sequence[str], tokenizer_path: str, out: str, *, val_fraction: float = 0.0,
                val_inputs: Sequence[str] = (), chat_template: str | None = None, eos: str | None = None,
                shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False, progress: bool = True,
                batch_bytes: int = BATCH_TEXT_BYTES, keep_tokens: int = KEEP_TOKENS) -> SftReport:
    """Renders, tokenizes and masks the examples of ``inputs`` (globs of JSON lines) into the prepared
    directory ``out`` (see the module docstring). The ``val`` split takes example i (in input order)
    when floor((i+1) val_fraction) > floor(i val_fraction), or the examples of ``val_inputs``. Bad
    input is a one-line ``ConfigError`` naming the flag (and the file:line), raised before ``out``
    is touched. The checking pass keeps its results for the writing pass up to ``keep_tokens``
    tokens (5 bytes each at most); a larger input is rendered and tokenized again."""
    started = time.perf_counter()
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    if val_inputs and val_fraction:
        raise ConfigError("--val-input", "give --val-fraction or --val-input, not both")
    is_val = _val_selector(val_fraction)
    if shard_tokens < 1:
        raise ConfigError("--shard-tokens", f"must be a positive number of tokens, got {shard_tokens}")
    tokenizer = rendered_text_tokenizer(tokenizer_path)
    eos_token, eos_id = end_of_document_id(tokenizer, eos, "--eos")
    template = load_chat_template(tokenizer_path, tokenizer, eos_token, chat_template)
    if template.source == DEFAULT_TEMPLATE_SOURCE:
        console.print(f"chat template: {DEFAULT_TEMPLATE_SOURCE} (the tokenizer has none; see "
                      "meshtrain/data/chat_template.py DEFAULT_CHAT_TEMPLATE)", markup=False)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    out_dir = pathlib.Path(out).absolute()
    train_files, val_files = split_input_files(inputs, val_inputs, out_dir)
    for flag, files in (("--input", train_files), ("--val-input", val_files)):
        table = next((path for path in files if is_columnar(path)), None)
        if table is not None:
            raise ConfigError(flag, f"{table}: prepare-sft reads JSON lines, not parquet or Arrow files; convert it "
                              "to .jsonl (datasets: Dataset.to_json)")
    writable_directory(out_dir, "--out", create=False)
    check_out(out_dir, overwrite)
    special = _special_tokens(tokenizer)
    splits = [TRAIN, VAL] if val_files or val_fraction else [TRAIN]
    all_files = train_files + val_files
    total_bytes = sum(path.stat().st_size for path in all_files)

    def packed_batches() -> Iterator[dict[str, tuple[np.ndarray, np.ndarray, int, np.ndarray]]]:
        """Per batch of examples, per split: (ids, lengths, text bytes, mask), checked."""
        readers = [(_Reader(train_files, "--input", template, special), None)]
        if val_files:
            readers.append((_Reader(val_files, "--val-input", template, special), VAL))
        bar = _Progress(console, total_bytes, len(all_files), progress)
        with bar.bar:
            for batch in _batches(readers, is_val, batch_bytes):
                tokenized = _tokenized(tokenizer, batch, eos_id)
                packed = {}
                for split in splits:
                    chosen = [(example, ids, mask) for example, (ids, mask) in zip(batch, tokenized)
                              if example.split == split]
                    if chosen:
                        packed[split] = (np.concatenate([ids for _, ids, _ in chosen]).astype(dtype),
                                         np.array([len(ids) for _, ids, _ in chosen], np.int64),
                                         sum(example.size for example, _, _ in chosen),
                                         np.concatenate([mask for _, _, mask in chosen]))
                        counts[split] = [a + b for a, b in zip(counts[split], (
                            len(chosen), sum(example.turns for example, _, _ in chosen),
                            len(packed[split][0]), int(np.count_nonzero(packed[split][3]))))]
                yield packed
                shown = {split: types.SimpleNamespace(documents=numbers[0], tokens=numbers[2])
                         for split, numbers in counts.items()}
                bar.update(sum(r.bytes_read for r, _ in readers), sum(r.files_read for r, _ in readers), shown)

    # Pass 1: every example read, rendered, tokenized and checked; nothing written. Its results are
    # kept for pass 2 up to keep_tokens tokens; beyond, pass 2 renders and tokenizes them again.
    counts = {split: [0, 0, 0, 0] for split in splits}
    kept: list | None = []
    for packed in packed_batches():
        if kept is not None:
            kept.append(packed)
            if sum(counts[split][2] for split in splits) > keep_tokens:
                kept = None
    if val_fraction and not counts[VAL][0]:
        raise ConfigError("--val-fraction", f"{val_fraction} of {counts[TRAIN][0]} examples rounds down to no val "
                          "example; raise it or use --val-input")
    written = {split: SplitCounts(*values) for split, values in counts.items()}

    # Pass 2: the same examples, written (beside an already prepared --out, which they replace once complete).
    writable_directory(out_dir, "--out")
    with RunLock(out_dir, field="--out", holder="prepare"), \
            claimed(out_dir, overwrite, lambda line: console.print(line, markup=False)) as target:
        writers = {split: _SplitWriter(target, split, dtype, shard_tokens, masked=True) for split in splits}
        if kept is None:
            counts = {split: [0, 0, 0, 0] for split in splits}
        for packed in kept if kept is not None else packed_batches():
            for split, (ids, lengths, text_bytes, mask) in packed.items():
                writers[split].add(ids, lengths, text_bytes, mask)
        template_bytes = template.text.encode("utf-8")
        write_file(target / CHAT_TEMPLATE_FILE, template_bytes)
        loss_mask = {"chat_template": {"file": CHAT_TEMPLATE_FILE, "source": template.source,
                                       "sha256": hashlib.sha256(template_bytes).hexdigest()},
                     "variables": template.variables, "trained_role": ASSISTANT}
        finish(target, tokenizer_path, dtype, (eos_token, eos_id), vocab_size, writers, loss_mask)
    corpus = PreparedCorpus.open(str(out_dir), field="--out")
    return SftReport(corpus, written, template.source, time.perf_counter() - started)
