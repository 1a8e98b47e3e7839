"""Supervised fine-tuning (``prepare-sft``, the loss mask): the loss ignores prompt tokens exactly,
the mask survives document packing, equals one device on (2,2,2,1) and through pipeline schedules,
prepare renders like ``transformers``' ``apply_chat_template`` (ids and assistant-token mask, a real
ChatML template) and with the built-in default template, refuses bad input in one line without
touching what is already written, and the held-out evaluation reports the response-only loss.

The data is made here: a byte-level BPE of 300 ids trained on a small word list, plus ChatML's two
special tokens, and 64 examples (pairs and two-turn chats with a system message) of a few words.

Tolerances (fp32): losses rel 1e-5; gradients rel L2 1e-5 per parameter; against an independent
float64 cross-entropy over the response positions, rel 1e-5.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import jinja2
import jinja2.sandbox
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer

from meshtrain import logits as logits_cli
from meshtrain.data import DataConfig, DataSource, Packing, global_batch, make_dataset, make_held_out_dataset
from meshtrain.data.__main__ import main as data_main
from meshtrain.data.prepared import INDEX_FILE, PreparedCorpus
from meshtrain.data.chat_template import DEFAULT_CHAT_TEMPLATE
from meshtrain.data.sft import DEFAULT_TEMPLATE_SOURCE, prepare_sft
from meshtrain.data.tokenizer import train_bpe
from meshtrain.errors import ConfigError
from meshtrain.loss import cross_entropy_sum
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.train import main as train_main
from models.api import forward
from models.common import unconstrained
from utils import initial_state, MODEL, make_trainer, shard_writes_fill_the_disk

WORDS = ["what", "is", "the", "capital", "of", "france", "paris", "name", "a", "color", "blue", "red", "fruit",
         "apple", "say", "hi", "again", "be", "brief", "yes", "no", "python", "list", "sort", "return", "value"]
# ChatML, with transformers' {% generation %} marking the assistant text it masks.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>\n' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SEQ = 64
SFT_MODEL = dataclasses.replace(MODEL, vocab_size=320, num_layers=4, seq_len=SEQ)  # 4: interleaved 2 x 2
BATCH = 8


def _sentence(rng, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS, rng.integers(low, high))).capitalize() + rng.choice([".", "?", "!"])


def _examples(seed: int, count: int) -> list[dict]:
    """Pairs, and every third a two-turn chat with a system message (or a pair with one)."""
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(count):
        if i % 3 == 2:
            examples.append({"messages": [
                {"role": "system", "content": _sentence(rng, 1, 2)},
                {"role": "user", "content": _sentence(rng, 1, 4)},
                {"role": "assistant", "content": _sentence(rng, 1, 3)},
                {"role": "user", "content": _sentence(rng, 1, 3)},
                {"role": "assistant", "content": _sentence(rng, 1, 3)}]})
        else:
            example = {"prompt": _sentence(rng, 1, 5), "response": _sentence(rng, 1, 4)}
            if i % 6 == 1:
                example["system"] = _sentence(rng, 1, 2)
            examples.append(example)
    return examples


def _messages(example: dict) -> list[dict]:
    if "messages" in example:
        return example["messages"]
    system = [{"role": "system", "content": example["system"]}] if "system" in example else []
    return system + [{"role": "user", "content": example["prompt"]},
                     {"role": "assistant", "content": example["response"]}]


def _write_jsonl(path: pathlib.Path, records: list) -> pathlib.Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """Tokenizer directories (plain: no template; chatml: ChatML specials and tokenizer_config.json),
    the examples, and the two prepared corpora (25% held out)."""
    root = tmp_path_factory.mktemp("sft")
    rng = np.random.default_rng(0)
    plain = train_bpe([_sentence(rng, 3, 30) for _ in range(300)], 300, root / "plain").parent
    tokenizer = Tokenizer.from_file(str(plain / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    (root / "chatml").mkdir()
    tokenizer.save(str(root / "chatml" / "tokenizer.json"))
    (root / "chatml" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "tokenizer_class": "X"}))
    examples = _examples(1, 64)
    inputs = _write_jsonl(root / "examples.jsonl", examples)
    prepared = {}
    for name in ("plain", "chatml"):
        prepare_sft([str(inputs)], str(root / name), str(root / f"prepared-{name}"), val_fraction=0.25,
                    progress=False, shard_tokens=500)
        prepared[name] = root / f"prepared-{name}"
    return {"root": root, "plain": plain, "chatml": root / "chatml", "examples": examples, "inputs": inputs,
            "prepared": prepared}


def _documents(split) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, loss mask) of every document of a prepared split."""
    starts = split.document_starts()
    return [(split.tokens(a, b).astype(np.int64), split.loss_mask(a, b)) for a, b in itertools.pairwise(starts)]


def _spans(tokenizer: Tokenizer, ids: np.ndarray, mask: np.ndarray) -> tuple[list[str], str]:
    """The decoded runs of masked tokens, and the decoded unmasked tokens."""
    decode = lambda part: tokenizer.decode([int(i) for i in part], skip_special_tokens=False)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])], decode(ids[mask == 0])


# ---- prepare-sft ----

def test_chatml_template_equals_transformers_ids_and_assistant_mask(data):
    """Every example's ids are transformers' apply_chat_template ids then EOS, and its loss mask is
    transformers' assistant-token mask ({% generation %}), EOS not trained on."""
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(data["chatml"] / "tokenizer.json"), chat_template=CHATML,
                                        eos_token="<|im_end|>")
    corpus = PreparedCorpus.open(str(data["prepared"]["chatml"]))
    assert corpus.loss_mask["chat_template"]["source"] == str(data["chatml"] / "tokenizer_config.json")
    assert (pathlib.Path(corpus.path) / "chat_template.jinja").read_text() == CHATML
    eos = corpus.tokenizer.eos_id
    assert corpus.tokenizer.eos == "<|endoftext|>"  # the document end; the template's eos_token is <|im_end|>
    documents = _documents(corpus.splits["train"]) + _documents(corpus.splits["val"])
    # val takes example i when floor((i+1)/4) > floor(i/4): examples 3, 7, 11, ...
    order = [i for i in range(64) if (i + 1) % 4] + [i for i in range(64) if not (i + 1) % 4]
    assert len(documents) == 64
    tokenizer = Tokenizer.from_file(str(data["chatml"] / "tokenizer.json"))
    for number, (ids, mask) in zip(order, documents):
        messages = _messages(data["examples"][number])
        expected = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        np.testing.assert_array_equal(ids, expected["input_ids"] + [eos])
        np.testing.assert_array_equal(mask, expected["assistant_masks"] + [0])
        spans, _ = _spans(tokenizer, ids, mask)
        assert spans == [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
    split = corpus.splits["train"]
    assert split.loss_tokens == sum(int(mask.sum()) for _, mask in _documents(split))
    corpus.verify()


def test_default_template_for_a_tokenizer_without_one(data, tmp_path, capsys):
    """The built-in template: each response and its EOS trained on, the prompt not; the EOS that
    ends the response ends the document (not doubled); the same input gives the same bytes."""
    out = tmp_path / "out"
    assert data_main(["prepare-sft", "--tokenizer", str(data["plain"]), "--input", str(data["inputs"]), "--out",
                      str(out), "--val-fraction", "0.25", "--no-progress", "--shard-tokens", "500"]) == 0
    captured = capsys.readouterr()
    assert f"chat template: {DEFAULT_TEMPLATE_SOURCE} (the tokenizer has none" in captured.err
    lines = captured.out.splitlines()
    assert lines[0].startswith(f"{out} train: 48 examples, 64 assistant turns, ") and "trained on" in lines[0]
    assert lines[1].startswith(f"{out} val: 16 examples, ")
    prepared = data["prepared"]["plain"]
    for path in prepared.iterdir():  # the fixture's run wrote the same bytes, index.json but the paths alike
        if path.name != INDEX_FILE:
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    corpus = PreparedCorpus.open(str(out))
    assert (out / "chat_template.jinja").read_text() == DEFAULT_CHAT_TEMPLATE
    tokenizer = Tokenizer.from_file(str(data["plain"] / "tokenizer.json"))
    order = [i for i in range(64) if (i + 1) % 4]
    for number, (ids, mask) in zip(order, _documents(corpus.splits["train"])):
        messages = _messages(data["examples"][number])
        spans, prompt = _spans(tokenizer, ids, mask)
        assert spans == [m["content"] + "<|endoftext|>" for m in messages if m["role"] == "assistant"]
        assert "<|endoftext|>" not in prompt and ids[-1] == corpus.tokenizer.eos_id
        assert prompt.startswith(messages[0]["content"] if messages[0]["role"] == "system" else "### Instruction:\n")
        assert prompt.endswith("### Response:\n")


def test_val_input_and_a_template_file(data, tmp_path):
    val = _write_jsonl(tmp_path / "val.jsonl", _examples(2, 5))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token if m['role'] == "
                        "'assistant' }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    report = prepare_sft([str(data["inputs"])], str(data["chatml"]), str(tmp_path / "out"), val_inputs=[str(val)],
                         chat_template=str(template), progress=False)
    assert report.template_source == str(template)
    assert report.counts["train"].examples == 64 and report.counts["val"].examples == 5
    tokenizer = Tokenizer.from_file(str(data["chatml"] / "tokenizer.json"))
    ids, mask = _documents(report.corpus.splits["val"])[0]
    messages = _messages(_examples(2, 5)[0])
    # The template's newline after EOS is part of the assistant's turn (rendered with it).
    assert _spans(tokenizer, ids, mask)[0] == [m["content"] + "<|im_end|>\n" for m in messages
                                               if m["role"] == "assistant"]


BAD_LINES = [
    ("not json", "is not a line of JSON"),
    ('["prompt", "response"]', "is a list, not a JSON object"),
    ('{"text": "x"}', 'has neither "messages" nor "prompt" and "response" (its keys: text)'),
    ('{"prompt": "x", "response": 3}', '"response" is a number, not text'),
    ('{"messages": []}', '"messages" is not a non-empty list'),
    ('{"messages": [{"role": "user", "content": "x"}]}', 'has no message with role "assistant"'),
    ('{"messages": [{"role": "assistant"}]}', "messages[0].content is missing, not text"),
    ('{"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]}',
     "messages[0].content is a list, not text"),
    ('{"prompt": "x", "response": "y", "messages": []}', 'has both "messages" and "prompt"/"response"'),
    ('{"prompt": "x <|endoftext|> y", "response": "z"}', "holds '<|endoftext|>', a special token of the tokenizer"),
    ('{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}',
     "the chat template (the built-in default) refused it: the built-in chat template knows the roles system, "
     "user and assistant, not tool"),
]


@pytest.mark.parametrize("line,message", BAD_LINES, ids=[f"bad{i}" for i in range(len(BAD_LINES))])
def test_bad_lines_are_refused_in_one_line_and_nothing_written_is_lost(data, tmp_path, capsys, line, message):
    out = tmp_path / "out"
    assert data_main(["prepare-sft", "--tokenizer", str(data["plain"]), "--input", str(data["inputs"]),
                      "--out", str(out), "--no-progress"]) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Say hi.", "response": "Hi."}\n\n' + line + "\n")
    capsys.readouterr()
    assert data_main(["prepare-sft", "--tokenizer", str(data["plain"]), "--input", str(bad), "--out", str(out),
                      "--no-progress", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("chat template:"), err  # the note, then one error line
    assert err[1].startswith(f"error: --input: {bad}:3") and message in err[1], err[1]
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # the corpus is intact


def test_a_prompt_whose_tokens_are_not_a_prefix_is_refused(data, tmp_path):
    """A generation prompt ending in a space: ' capital' starts with a token 'Ġc' in the whole, so the
    prompt's tokens (ending in 'Ġ') are not a prefix; refused, naming the line and the tokens."""
    template = tmp_path / "answer.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] }}\n"
                        "{% else %}Answer: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
                        "{% if add_generation_prompt %}Answer:{{ ' ' }}{% endif %}")
    tokenizer = Tokenizer.from_file(str(data["plain"] / "tokenizer.json"))
    word = next(w for w in WORDS if tokenizer.encode(" " + w).tokens[0] != "Ġ")  # a merge across the space
    first = tokenizer.encode(" " + word).tokens[0]
    inputs = _write_jsonl(tmp_path / "x.jsonl", [{"prompt": "What is it?", "response": f"{word} is it."}])
    with pytest.raises(ConfigError, match=rf"--input: {inputs}:1: assistant turn 1: the tokens of the conversation "
                       r"before it with the generation prompt are not a prefix of the whole conversation's \(token "
                       rf"\d+ is 'Ġ' there but '{first}' in the whole conversation\)"):
        prepare_sft([str(inputs)], str(data["plain"]), str(tmp_path / "out"), chat_template=str(template),
                    progress=False)
    assert not (tmp_path / "out").exists()


def test_template_and_option_errors(data, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match=r"--chat-template: the chat template of .*broken.jinja is not valid Jinja "
                       r"\(its line 1: "):
        prepare_sft([str(data["inputs"])], str(data["plain"]), str(tmp_path / "o1"), chat_template=str(broken))
    with pytest.raises(ConfigError, match="--chat-template: no such file"):
        prepare_sft([str(data["inputs"])], str(data["plain"]), str(tmp_path / "o2"), chat_template="missing.jinja")
    with pytest.raises(ConfigError, match=r"--val-fraction: 0\.01 of 64 examples rounds down to no val example"):
        prepare_sft([str(data["inputs"])], str(data["plain"]), str(tmp_path / "o3"), val_fraction=0.01,
                    progress=False)
    with pytest.raises(ConfigError, match=r"--out: .* is already prepared"):
        prepare_sft([str(data["inputs"])], str(data["plain"]), str(data["prepared"]["plain"]), progress=False)
    bad_val = _write_jsonl(tmp_path / "val.jsonl", [{"prompt": "x"}])
    with pytest.raises(ConfigError, match=rf"--val-input: {bad_val}:1 has neither"):
        prepare_sft([str(data["inputs"])], str(data["plain"]), str(tmp_path / "o4"), val_inputs=[str(bad_val)],
                    progress=False)
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3", "o4"))


def test_the_output_does_not_depend_on_batching_or_the_kept_tokens(data, tmp_path):
    """A small batch, and an input larger than the tokens the checking pass keeps (rendered and
    tokenized again in the writing pass), write the same bytes."""
    prepare_sft([str(data["inputs"])], str(data["plain"]), str(tmp_path / "out"), val_fraction=0.25,
                progress=False, shard_tokens=500, batch_bytes=300, keep_tokens=100)
    for path in data["prepared"]["plain"].iterdir():
        assert (tmp_path / "out" / path.name).read_bytes() == path.read_bytes(), path.name


# ---- issue 53: rendering bounded, rendered once, the template's tokens, --overwrite ----

def _prefix_rendered(tokenizer: Tokenizer, template: str, variables: dict, messages: list[dict]):
    """The ids and mask of the earlier algorithm, for reference: the template (its {% generation %}
    marks dropped) rendered once per assistant turn before and up to it, each text tokenized."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    compiled = environment.from_string(re.sub(r"{%-? *(end)?generation *-?%}", "", template))
    encode = lambda part, prompt: tokenizer.encode(compiled.render(messages=part, add_generation_prompt=prompt,
                                                                   **variables), add_special_tokens=False).ids
    ids = encode(messages, False)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt, upto = encode(messages[:k], True), encode(messages[:k + 1], False)
            assert ids[:len(prompt)] == prompt and ids[:len(upto)] == upto
            mask[len(prompt):len(upto)] = [1] * (len(upto) - len(prompt))
    return ids, mask


def test_the_mask_is_the_one_each_turn_rendered_alone_gives(data, tmp_path):
    """Rendering once (a template with {% generation %}: the built-in one, ChatML) or rendering each
    turn's prefixes but tokenizing the whole only (a template without) gives the ids and mask that
    tokenizing each turn's prefixes gave."""
    unmarked = tmp_path / "chatml.jinja"
    unmarked.write_text(re.sub(r"{%-? *(end)?generation *-?%}", "", CHATML))
    prepare_sft([str(data["inputs"])], str(data["chatml"]), str(tmp_path / "unmarked"), chat_template=str(unmarked),
                progress=False)
    train = [i for i in range(64) if (i + 1) % 4]
    cases = [(data["prepared"]["plain"], DEFAULT_CHAT_TEMPLATE, {"eos_token": "<|endoftext|>"}, train),
             (data["prepared"]["chatml"], CHATML, {"eos_token": "<|im_end|>"}, train),
             (tmp_path / "unmarked", CHATML, {"eos_token": "<|im_end|>"}, range(64))]
    for prepared, template, variables, order in cases:
        corpus = PreparedCorpus.open(str(prepared))
        tokenizer = Tokenizer.from_file(corpus.tokenizer.file)
        eos = corpus.tokenizer.eos_id
        for number, (ids, mask) in zip(order, _documents(corpus.splits["train"]), strict=True):
            expected, expected_mask = _prefix_rendered(tokenizer, template, variables,
                                                       _messages(data["examples"][number]))
            ends_in_eos = expected[-1] == eos
            assert ids.tolist() == expected + ([] if ends_in_eos else [eos]), (prepared, number)
            assert mask.tolist() == expected_mask + ([] if ends_in_eos else [0]), (prepared, number)


def _counting_renders(monkeypatch) -> list[int]:
    """The characters of each rendering Jinja makes from now on (one entry a rendering)."""
    rendered = []
    generate = jinja2.Template.generate

    def counting(self, *args, **kwargs):
        rendered.append(0)
        for piece in generate(self, *args, **kwargs):
            rendered[-1] += len(piece)
            yield piece

    monkeypatch.setattr(jinja2.Template, "generate", counting)
    return rendered


def test_a_thousand_turn_chat_is_rendered_once(data, tmp_path, monkeypatch):
    """A 1 MB chat of 1,000 messages (500 assistant turns) was rendered twice more per turn (the
    prefixes: 12 GB); with the built-in template (its responses marked) it is rendered once."""
    rng = np.random.default_rng(3)
    messages = [{"role": ("user", "assistant")[i % 2], "content": " ".join(rng.choice(WORDS, 200))}
                for i in range(1000)]
    inputs = _write_jsonl(tmp_path / "long.jsonl", [{"messages": messages}])
    assert inputs.stat().st_size > 1_000_000
    rendered = _counting_renders(monkeypatch)
    report = prepare_sft([str(inputs)], str(data["plain"]), str(tmp_path / "out"), progress=False)
    split = report.corpus.splits["train"]
    assert rendered == [split.text_bytes]  # one rendering, of exactly the text written
    assert report.counts["train"].assistant_turns == 500
    spans, _ = _spans(Tokenizer.from_file(str(data["plain"] / "tokenizer.json")), *_documents(split)[0])
    assert spans == [m["content"] + "<|endoftext|>" for m in messages if m["role"] == "assistant"]


def test_a_template_without_generation_marks_renders_three_times_and_is_bounded(data, tmp_path, monkeypatch, capsys):
    """Without {% generation %} each turn's prefixes are derived from two traced renderings of the whole
    (meshtrain/data/chat_turns.py): 3 renderings for 20 turns (there were 1 + 2 per turn). A template
    whose prefixes cannot be derived (it reads the count of the messages) renders them, and a chat past
    PREFIX_RENDER_CHARACTERS is refused in one line."""
    from meshtrain.data import chat_turns

    loop = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token if m['role'] == 'assistant' }}\n"
    template, counting = tmp_path / "plain.jinja", tmp_path / "counting.jinja"
    template.write_text(loop + "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    counting.write_text(loop + "{% if messages|length < 0 %}!{% endif %}{% endfor %}{% if add_generation_prompt %}"
                        "<assistant>{% endif %}")
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"{WORDS[i % 26]} {WORDS[i % 7]}"}
                for i in range(40)]
    inputs = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    rendered = _counting_renders(monkeypatch)
    report = prepare_sft([str(inputs)], str(data["plain"]), str(tmp_path / "out"), chat_template=str(template),
                         progress=False)
    assert len(rendered) == 3 and report.counts["train"].assistant_turns == 20
    spans, _ = _spans(Tokenizer.from_file(str(data["plain"] / "tokenizer.json")),
                      *_documents(report.corpus.splits["train"])[0])
    assert spans == [m["content"] + "<|endoftext|>\n" for m in messages[1::2]]
    text_bytes = report.corpus.splits["train"].text_bytes
    monkeypatch.setattr(chat_turns, "PREFIX_RENDER_CHARACTERS", 39 * (text_bytes // 2) - 1)
    assert data_main(["prepare-sft", "--tokenizer", str(data["plain"]), "--input", str(inputs), "--out",
                      str(tmp_path / "again"), "--chat-template", str(counting), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --input: {inputs}:1: its 20 assistant turns would render "), err
    assert f"the chat template ({counting}) does not mark the assistant text with {{% generation %}}" in err[0]
    assert not (tmp_path / "again").exists()


BAD_TEMPLATES = [
    ("{% include 'turn.jinja' %}", None, "uses {% include %} (its line 1); a chat template is one file that loads "
     "no other"),
    ("{% extends 'base.jinja' %}", None, "uses {% extends %} (its line 1)"),
    ("{% from 'macros.jinja' import turn %}{{ turn(messages) }}", None, "uses {% from ... import %} (its line 1)"),
    ("{% import 'macros.jinja' as m %}", None, "uses {% import %} (its line 1)"),
    ("{% macro turn(m) %}{{ turn(m) }}{% endmacro %}\n{{ turn(messages) }}", 1,
     "recursed too deeply on it (its line 1): a macro that calls itself without end?"),
    ("{% for m in messages %}\n{{ m['content'] | length // 0 }}{% endfor %}", 1,
     "failed on it (its line 2): ZeroDivisionError: integer division or modulo by zero"),
    ("{% for m in messages %}{{ m['content'] + loop.index }}{% endfor %}", 1,
     'failed on it (its line 1): TypeError: can only concatenate str (not "int") to str'),
    ("{{ range(200000) | length }}", 1, "failed on it (its line 1): OverflowError: Range too big. The sandbox blocks "
     "ranges larger than MAX_RANGE (100000)."),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", 1,
     "steps (loop iterations, calls and the characters they make), the most its rendering may take: a loop or a "
     "recursion without end? (its line 1)"),  # 10**10 iterations: stopped at the step budget, at once
    ("{{ 'a' * 10 ** 10 }}", 1, "refused it: * would make a string or list of 10,000,000,000 items, more than the "
     "16,777,216 characters a rendering may write (its line 1)"),  # was the trainer's out-of-memory line
    ("{% for i in range(2000) %}{{ messages[1]['content'] }}{% endfor %}", 1,
     "renders it to more than 16,777,216 characters, the most tokenized at once; shorten it"),
]


@pytest.mark.parametrize("text,line,message", BAD_TEMPLATES, ids=[f"bad{i}" for i in range(len(BAD_TEMPLATES))])
def test_a_template_that_fails_is_one_line_naming_it_and_the_example(data, tmp_path, capsys, text, line, message):
    """Loading other files, recursing, dividing by zero, adding text to a number, passing the
    sandbox's range limit, looping 10**10 times, building a 10 GB string or rendering past what is
    tokenized at once: one line naming the template (and the example's file:line), exit 2."""
    template = tmp_path / "t.jinja"
    template.write_text(text)
    inputs = _write_jsonl(tmp_path / "x.jsonl", [{"prompt": "Say hi.", "response": "Hi. " * 2500}] * 2)
    assert data_main(["prepare-sft", "--tokenizer", str(data["plain"]), "--input", str(inputs), "--out",
                      str(tmp_path / "out"), "--chat-template", str(template), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    if line is None:
        assert err[0].startswith(f"error: --chat-template: the chat template of {template} "), err
    else:
        assert err[0].startswith(f"error: --input: {inputs}:{line}: the chat template ({template}) "), err
    assert message in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_tokenizers_own_template_that_fails_or_is_not_utf8_is_one_line(data, tmp_path, capsys):
    """The error names the tokenizer directory's chat_template.jinja (or its tokenizer_config.json)
    as the template's source; a chat_template.jinja that is not UTF-8 is one line too."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_bytes((data["plain"] / "tokenizer.json").read_bytes())
    inputs = _write_jsonl(tmp_path / "x.jsonl", [{"prompt": "Say hi.", "response": "Hi."}])
    command = ["prepare-sft", "--tokenizer", str(tokenizer), "--input", str(inputs), "--out", str(tmp_path / "out"),
               "--no-progress"]
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].x.y }}"}))
    assert data_main(command) == 2
    assert capsys.readouterr().err == (f"error: --input: {inputs}:1: the chat template ({tokenizer}/"
                                       "tokenizer_config.json) refused it: 'dict object' has no attribute 'x' (its "
                                       "line 1)\n")
    (tokenizer / "chat_template.jinja").write_text("{{ 1 / 0 }}")
    assert data_main(command) == 2
    assert capsys.readouterr().err == (f"error: --input: {inputs}:1: the chat template ({tokenizer}/"
                                       "chat_template.jinja) failed on it (its line 1): ZeroDivisionError: division "
                                       "by zero\n")
    (tokenizer / "chat_template.jinja").write_bytes(b"{{ messages }}\n{# caf\xe9 #}")
    assert data_main(command) == 2
    assert capsys.readouterr().err == (f"error: --tokenizer: {tokenizer}/chat_template.jinja is not UTF-8 text (byte "
                                       "21); save the chat template as UTF-8\n")
    assert not (tmp_path / "out").exists()


def test_an_eos_token_the_tokenizer_does_not_hold_is_refused(data, tmp_path, capsys):
    """tokenizer_config.json's eos_token '</s>', not a token of this tokenizer: the template would
    write its four characters as text (trained on) and the real EOS after them would have mask 0.
    A special token the template does not use is left alone."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_bytes((data["plain"] / "tokenizer.json").read_bytes())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    command = ["prepare-sft", "--tokenizer", str(tokenizer), "--input", str(data["inputs"]), "--out",
               str(tmp_path / "out"), "--no-progress"]
    assert data_main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    count = len(Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode("</s>").ids)
    assert err[-1] == (f"error: --tokenizer: {tokenizer}/tokenizer_config.json: eos_token '</s>' is not a token of "
                       f"the tokenizer, so the chat template would write it as text ({count} tokens): the mask would "
                       "train on its characters and the model never learn to stop; set it to one of its special "
                       "tokens (<|endoftext|>), or remove it"), err
    assert not (tmp_path / "out").exists()
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<pad>"}))
    assert data_main(command) == 0


def test_overwrite_onto_a_full_disk_keeps_the_old_corpus(data, tmp_path, monkeypatch, capsys):
    """prepare-sft --overwrite writes the new corpus beside the old one and swaps it in when complete:
    a write failing midway (ENOSPC) is one line, the old corpus (and a file beside it) is intact and
    no temporary directory is left; once there is room, the new corpus replaces it."""
    out = tmp_path / "out"
    command = ["prepare-sft", "--tokenizer", str(data["plain"]), "--input", str(data["inputs"]), "--out", str(out),
               "--no-progress", "--shard-tokens", "200"]
    assert data_main(command) == 0
    (out / "notes.md").write_text("mine")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    other = _write_jsonl(tmp_path / "other.jsonl", _examples(5, 40))
    shard_writes_fill_the_disk(monkeypatch, 3, "train-00001.bin")
    capsys.readouterr()
    command[command.index(str(data["inputs"]))] = str(other)
    assert data_main([*command, "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[1].startswith("error: --out: cannot write ") and err[1].endswith(
        f"train-00001.bin.tmp: No space left on device; {out} is left as it was"), err
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other.jsonl", "out"]
    monkeypatch.undo()
    assert data_main([*command, "--overwrite"]) == 0
    assert PreparedCorpus.open(str(out)).splits["train"].num_documents == 40
    assert (out / "notes.md").read_text() == "mine" and not (out / ".meshtrain.lock").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other.jsonl", "out"]


# ---- the loss ----

def test_cross_entropy_ignores_masked_positions_exactly():
    """cross_entropy_sum: the logits and targets at masked positions do not move the sum by one bit,
    and it equals a float64 cross-entropy over the unmasked positions alone."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 16, 50)).astype(np.float32) * 3
    targets = rng.integers(0, 50, (4, 16))
    mask = (rng.random((4, 16)) < 0.4).astype(np.float32)
    total = float(cross_entropy_sum(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask)))
    prompt = mask == 0
    moved_logits = logits.copy()
    moved_logits[prompt] = rng.normal(size=(int(prompt.sum()), 50)) * 100
    moved_targets = np.where(prompt, (targets + 17) % 50, targets)
    moved = float(cross_entropy_sum(jnp.asarray(moved_logits), jnp.asarray(moved_targets), jnp.asarray(mask)))
    assert moved == total
    log_probs = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    reference = -sum(log_probs[b, t, targets[b, t]] for b, t in zip(*np.nonzero(mask)))
    assert total == pytest.approx(reference, rel=1e-6)


def _alone_logits(params, graphdef, inputs: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Logits [rows, length, vocab] with every document piece of each row run alone on one device."""
    pieces, places = [], []
    for row in range(inputs.shape[0]):
        for segment in np.unique(segments[row][segments[row] > 0]):
            where = np.flatnonzero(segments[row] == segment)
            pieces.append(np.pad(inputs[row, where], (0, inputs.shape[1] - where.size)))
            places.append((row, where))
    run = jax.jit(lambda p, tokens: forward(nnx.merge(graphdef, p), tokens, unconstrained))
    out_logits = np.asarray(run(params, jnp.asarray(np.stack(pieces))))
    out = np.zeros((*inputs.shape, out_logits.shape[-1]), np.float32)
    for piece, (row, where) in zip(out_logits, places):
        out[row, where] = piece[:where.size]
    return out


def _response_loss(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """(sum, count) of the float64 cross-entropy over the positions ``mask`` keeps."""
    logits = logits.astype(np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    token_loss = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    return float((token_loss * mask).sum()), float(mask.sum())


def _expected_mask(split, windows: np.ndarray) -> np.ndarray:
    """mask [n, SEQ] of windows ``windows`` (numbers) of a packed split, built independently: the
    target is a response token of the same document as its input, inside the stream."""
    starts = split.document_starts()
    tokens = np.arange(split.num_tokens)
    document = np.searchsorted(starts, tokens, side="right") - 1
    loss = split.loss_mask(0, split.num_tokens)
    out = np.zeros((len(windows), SEQ), np.float32)
    for row, window in enumerate(windows):
        for t in range(SEQ):
            source, target = window * (SEQ + 1) + t, window * (SEQ + 1) + t + 1
            if target < split.num_tokens and document[source] == document[target]:
                out[row, t] = loss[target]
    return out


def _flat(tree) -> dict:
    return {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(tree)}


@pytest.fixture(scope="module")
def single_device(data):
    """On one device, a packed batch of the ChatML corpus: the batch, loss, gradients, evaluation,
    and the loss and gradients with the prompt positions' targets changed."""
    trainer = make_trainer((1, 1, 1, 1), SFT_MODEL, batch_size=BATCH)
    cfg = DataConfig(source=DataSource.TOKENS, path=str(data["prepared"]["chatml"]), packing=Packing.DOCUMENTS)
    dataset = make_dataset(cfg, vocab_size=SFT_MODEL.vocab_size, seq_len=SEQ)
    batch = global_batch(dataset, 0, BATCH, trainer.batch_sharding)
    state = initial_state(trainer)
    gradients = jax.jit(trainer.gradients)
    loss, grads, count, *_ = gradients(state, batch)
    host = {key: np.asarray(value) for key, value in batch.items()}
    prompt = host["mask"] == 0
    moved = dict(batch, targets=jnp.asarray(np.where(prompt, (host["targets"] + 5) % 300, host["targets"])))
    moved_loss, moved_grads, *_ = gradients(state, moved)
    alone = _alone_logits(jax.device_get(state.params), trainer.graphdef, host["inputs"], host["segments"])
    return {"dataset": dataset, "host": host, "loss": float(loss), "count": float(count), "grads": _flat(grads),
            "moved": (float(moved_loss), _flat(moved_grads)), "alone": alone,
            "eval": jax.device_get(trainer.eval_step(state.params, batch))}


def test_packed_mask_is_documents_times_responses(data, single_device):
    host, dataset = single_device["host"], single_device["dataset"]
    split = PreparedCorpus.open(str(data["prepared"]["chatml"])).splits["train"]
    windows = dataset.windows(np.arange(BATCH))
    np.testing.assert_array_equal(host["mask"], _expected_mask(split, windows))
    assert (host["segments"].max(1) >= 2).sum() >= BATCH // 2  # rows hold several examples
    assert 0 < host["mask"].sum() < 0.5 * (host["segments"] > 0).sum()  # most targets are prompt tokens


def test_the_loss_ignores_prompt_tokens_exactly(single_device):
    """Targets changed at every prompt position: the loss and every gradient are bit-identical; the
    loss equals a float64 cross-entropy over the response positions of each example run alone."""
    moved_loss, moved_grads = single_device["moved"]
    assert moved_loss == single_device["loss"]
    for name, grad in single_device["grads"].items():
        np.testing.assert_array_equal(moved_grads[name], grad, err_msg=name)
    host = single_device["host"]
    total, count = _response_loss(single_device["alone"], host["targets"], host["mask"])
    assert count == single_device["count"]
    assert single_device["loss"] == pytest.approx(total / count, rel=1e-5)
    # The test can fail: the same logits over every target of the documents give another loss.
    documents = (host["segments"] > 0) & (np.roll(host["segments"], -1, 1) == host["segments"])
    everything, every_count = _response_loss(single_device["alone"], host["targets"], documents.astype(np.float32))
    assert abs(everything / every_count - single_device["loss"]) > 1e-2


# The loss mask is batch data that only the head's loss reads, on the last stage in every schedule: one
# schedule with virtual stages and one without prove it (every schedule's gradients: test_pipeline.py).
PIPELINES = {"1f1b": PipelineConfig(2, Schedule.ONE_F_ONE_B),
             "interleaved": PipelineConfig(2, Schedule.INTERLEAVED, virtual_stages=2)}


@pytest.mark.parametrize("mesh_shape,pipeline,preset", [
    ((2, 2, 2, 1), "none", Preset.FSDP_TP),
    pytest.param((2, 2, 1, 2), "1f1b", Preset.FSDP_TP, marks=pytest.mark.slow),
    pytest.param((2, 1, 1, 2), "interleaved", Preset.FSDP_TP, marks=pytest.mark.slow),
    pytest.param((1, 4, 1, 1), "none", Preset.FSDP_CP_RING, marks=pytest.mark.slow)],
    ids=["2x2x2x1", "1f1b", "interleaved", "cp_ring_balanced"])
def test_the_masked_loss_equals_one_device_in_every_layout(data, single_device, mesh_shape, pipeline, preset):
    """Under ring attention the balanced order permutes the mask with the targets it belongs to."""
    trainer = make_trainer(mesh_shape, SFT_MODEL, rules=preset.rules,
                           pipeline=PIPELINES.get(pipeline, PipelineConfig()), batch_size=BATCH)
    batch = global_batch(single_device["dataset"], 0, BATCH, trainer.batch_sharding)
    np.testing.assert_array_equal(np.asarray(batch["mask"]), single_device["host"]["mask"])
    state = initial_state(trainer)
    loss, grads, count, *_ = jax.jit(trainer.gradients)(state, batch)
    assert float(count) == single_device["count"]
    assert float(loss) == pytest.approx(single_device["loss"], rel=1e-5)
    for name, grad in _flat(trainer.layer_order.to_logical(grads)).items():
        reference = single_device["grads"][name]
        assert np.linalg.norm(grad - reference) / np.linalg.norm(reference) <= 1e-5, name
    evaluated = jax.device_get(trainer.eval_step(state.params, batch))
    assert float(evaluated["target_tokens"]) == single_device["count"]
    assert float(evaluated["loss_sum"]) == pytest.approx(float(single_device["eval"]["loss_sum"]), rel=1e-5)


# ---- evaluation on the held-out examples ----

def test_held_out_evaluation_reports_the_response_only_loss(data, tmp_path):
    """prepare-sft -> train with evaluation on the val split (concat packing, (2,2,2,1)): the eval
    loss equals the float64 cross-entropy over the val windows' response targets of
    meshtrain.logits' logits, and not the loss over all targets."""
    prepared = data["prepared"]["plain"]
    run = tmp_path / "run"
    argv = ["train.steps=2", f"train.batch_size={BATCH}", "train.log_every=1", "eval.every=2", "eval.batches=1",
            "data.source=tokens", f"data.path={prepared}", f"run.dir={run}", "train.precision=fp32",
            "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", f"model.vocab_size={SFT_MODEL.vocab_size}",
            "model.embed_dim=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
            "model.head_dim=8", "model.mlp_dim=64", f"model.seq_len={SEQ}"]
    assert train_main(argv) == 0
    # The run records the corpus' chat template beside its tokenizer (what generate --chat renders).
    assert (run / "chat_template.jinja").read_text() == (prepared / "chat_template.jinja").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval_loss" in r][-1]
    split = PreparedCorpus.open(str(prepared)).split("val")
    held_out = make_held_out_dataset(DataConfig(source=DataSource.TOKENS, path=str(prepared)), None, path="",
                                     split="val", field="eval.path", vocab_size=SFT_MODEL.vocab_size, seq_len=SEQ)
    rows = held_out.rows(np.arange(BATCH))
    window = SEQ + 1
    tokens = np.stack([split.tokens(w * window, (w + 1) * window) for w in range(BATCH)]).astype(np.int64)
    loss_mask = np.stack([split.loss_mask(w * window, (w + 1) * window) for w in range(BATCH)])
    np.testing.assert_array_equal(rows["mask"], loss_mask[:, 1:])
    np.save(tmp_path / "windows.npy", tokens[:, :-1])
    assert logits_cli.main(["--model", str(run), "--tokens", str(tmp_path / "windows.npy"),
                            "--out", str(tmp_path / "logits.npy")]) == 0
    logits = np.load(tmp_path / "logits.npy")
    total, count = _response_loss(logits, tokens[:, 1:], loss_mask[:, 1:].astype(np.float64))
    assert 0 < count < 0.5 * tokens[:, 1:].size
    assert evaluated["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    every, every_count = _response_loss(logits, tokens[:, 1:], np.ones(tokens[:, 1:].shape))
    assert abs(every / every_count - evaluated["eval_loss"]) > 1e-2
    assert math.isclose(evaluated["eval_perplexity"], math.exp(evaluated["eval_loss"]), rel_tol=1e-9)


@pytest.mark.slow  # the fast tier's SFT data: the prepare-sft tests
def test_the_make_sft_instruction_set_is_valid_input(tmp_path):
    """scripts/stdlib_instructions.py (make sft) writes pairs and two-turn chats that prepare-sft reads."""
    import subprocess
    import sys

    from meshtrain.data.sft import conversation

    repo = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "instructions.jsonl"
    subprocess.run([sys.executable, str(repo / "scripts" / "stdlib_instructions.py"), "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    chats = [conversation(record, f"line {number}") for number, record in enumerate(records, 1)]
    assert len(records) > 1000
    assert {len(chat) for chat in chats} == {2, 5}  # pairs, and system + two turns
    assert all(chat[-1]["role"] == "assistant" and chat[-1]["content"] for chat in chats)


def test_generate_chat_renders_the_prompt_as_prepare_sft_does(data, tmp_path, monkeypatch):
    """Issue 52, item 3: ``generate --chat`` sends transformers' apply_chat_template ids (with the
    generation prompt) of the tokenizer directory's template, and stops at its eos_token."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    from meshtrain import generate
    from utils import tiny_hf

    model_dir = tiny_hf(tmp_path / "hf", model=[f"model.vocab_size={SFT_MODEL.vocab_size}"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(data["chatml"] / name, model_dir / name)
    sent = {}
    real = generate.continue_ids

    def recording(model, tokenizer, ids, *args, **kwargs):
        sent.update(ids=list(ids), eos_id=tokenizer.eos_id)
        return real(model, tokenizer, ids, *args, **kwargs)

    monkeypatch.setattr(generate, "continue_ids", recording)
    printed = []
    assert generate.main(["--hf", str(model_dir), "--prompt", "one two", "--system", "be brief", "--chat",
                          "--max-new-tokens", "2"], print_fn=printed.append) == 0
    reference = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), chat_template=CHATML)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert sent["ids"] == list(expected)
    assert sent["eos_id"] == reference.convert_tokens_to_ids("<|im_end|>") and len(printed) == 1
    assert generate.main(["--hf", str(model_dir), "--prompt", "x", "--system", "s"]) == 2  # --chat only
