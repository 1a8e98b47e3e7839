"""Issue 53, item 15: the assistant turns of a template without {% generation %} are found from two
traced renderings of the whole conversation (meshtrain/data/chat_turns.py), exactly where rendering
each prefix (the way transformers defines the mask) would find them, and in time linear in the turns.

The reference here renders every prefix with Jinja's own sandbox, independent of meshtrain's."""

from __future__ import annotations

import jinja2
import jinja2.sandbox
import pytest

from meshtrain.data import chat_turns
from meshtrain.data.chat_template import ChatTemplate
from meshtrain.errors import ConfigError

GENERATION_PROMPT = "{% if add_generation_prompt %}<assistant>{% endif %}"
TURN = "<{{ m.role }}>{{ m.content }};"
# Real templates' shapes (ChatML, Llama 3.1, Qwen 2.5, DeepSeek-V3, Phi-3, Mistral), cut down, and the
# constructs that change what a prefix renders: the messages' count, looking ahead, state kept in a
# namespace, cycler or joiner, loops whose output a block collects, views of the messages.
TEMPLATES = {
    "chatml": "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "llama3": "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
              "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
              "{{- '<|system|>' + system + '<|eot|>' }}{%- for message in messages %}"
              "{%- if not (message.role == 'tool' or 'tool_calls' in message) %}{{- '<|' + message['role'] + '|>' + "
              "message['content'] | trim + '<|eot|>' }}{%- else %}TOOL{%- endif %}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}",
    "qwen2.5": "{%- if messages[0]['role'] == 'system' %}{{- '<sys>' + messages[0]['content'] }}{%- else %}<sys>Qwen"
               "{%- endif %}{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' "
               "and not loop.first) or message.role == 'assistant' %}{{- '<' + message.role + '>' + message.content }}"
               "{%- elif message.role == 'tool' %}{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "
               "'tool' %}<user>{%- endif %}{{- '<tool>' + message.content }}{%- if loop.last or "
               "messages[loop.index0 + 1].role != 'tool' %}<end>{%- endif %}{%- endif %}{%- endfor %}"
               "{%- if add_generation_prompt %}<assistant>{%- endif %}",
    "deepseek-v3": "{% set ns = namespace(is_tool=false, system='') %}{%- for message in messages %}"
                   "{%- if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] %}"
                   "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system }}{%- for message in messages %}"
                   "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{ '<U>' + message['content'] }}"
                   "{%- elif message['role'] == 'assistant' %}"
                   "{{ ('<TE>' if ns.is_tool else '<A>') + message['content'] "
                   "+ '<E>' }}{%- set ns.is_tool = false -%}{%- elif message['role'] == 'tool' %}"
                   "{%- set ns.is_tool = true -%}{{ '<T>' + message['content'] }}{%- endif %}{%- endfor -%}"
                   "{% if ns.is_tool %}<TE>{% endif %}{% if add_generation_prompt and not ns.is_tool %}<A>{% endif %}",
    "phi3": "{% for m in messages %}" + TURN + "{% endfor %}{% if add_generation_prompt %}<assistant>{% else %}"
            "{{ eos_token }}{% endif %}",
    "mistral": "{%- for m in messages %}{%- if m.role == 'user' and loop.last %}[LAST]{% endif %}" + TURN
               + "{%- endfor %}" + GENERATION_PROMPT,
    "count": "{% for m in messages %}" + TURN + "{% if loop.index0 == (messages|length) - 1 %}.{% endif %}{% endfor %}"
             + GENERATION_PROMPT,
    "nextitem": "{% for m in messages %}" + TURN + "{% if loop.nextitem is defined %}+{% endif %}{% endfor %}"
                + GENERATION_PROMPT,
    "filter-block": "{% filter upper %}{% for m in messages %}" + TURN + "{% endfor %}{% endfilter %}"
                    + GENERATION_PROMPT,
    "macro-loop": "{% macro all(ms) %}{% for m in ms %}" + TURN + "{% endfor %}{% endmacro %}{{ all(messages) }}"
                  + GENERATION_PROMPT,
    "cycler": "{% set sep = joiner('') %}{% set parity = cycler('odd', 'even') %}{% for m in messages %}{{ sep() }}"
              "{% set _ = parity.next() %}" + TURN + "{% endfor %}" + GENERATION_PROMPT
              + "{% if add_generation_prompt and parity.current == 'odd' %}!{% endif %}",
    "namespace-count": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}" + TURN
                       + "{% endfor %}{% if add_generation_prompt %}<assistant {{ ns.n }}>{% endif %}",
    "namespace-text": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}" + TURN
                      + "{% endfor %}{% if add_generation_prompt %}<assistant {{ ns }}>{% endif %}",
    "last-role": "{% set ns = namespace(last='') %}{% for m in messages %}{% set ns.last = m.role %}" + TURN
                 + "{% endfor %}{% if add_generation_prompt and ns.last != 'assistant' %}<assistant>{% endif %}",
    "view-else": "{{ messages[0].content }}/{% for m in messages[1:] %}" + TURN + "{% else %}EMPTY{% endfor %}"
                 + GENERATION_PROMPT,
    "loop-filter": "{% for m in messages if m.role != 'system' %}" + TURN + "{% endfor %}" + GENERATION_PROMPT,
    "roles-first": "{% for m in messages %}{{ m.role[0] }}{% endfor %}|{% for m in messages %}" + TURN + "{% endfor %}"
                   + GENERATION_PROMPT,
    "break": "{% for m in messages %}{% if m.content == 'stop' %}{% break %}{% endif %}" + TURN + "{% endfor %}"
             + GENERATION_PROMPT,
    "footer": "{% for m in messages %}" + TURN + "{% endfor %}" + GENERATION_PROMPT + "<footer>",
    "tojson": "{{ messages|length }}{% for m in messages %}" + TURN + "{% endfor %}{{ (messages|tojson)[:0] }}"
              + GENERATION_PROMPT,
}
CONVERSATIONS = {
    "system": [("system", "be brief"), ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")],
    "tools": [("user", "q1"), ("assistant", "a1"), ("tool", "t1"), ("tool", "t2"), ("assistant", "a2"),
              ("user", "stop"), ("assistant", "a3")],
    "assistant-first": [("assistant", "a0"), ("user", "q1"), ("assistant", "a1"), ("assistant", "a2")],
    "late-system": [("user", "q1"), ("assistant", "a1"), ("system", "s"), ("user", "q2"), ("assistant", "a2"),
                    ("user", "q3")],
}
VARIABLES = {"eos_token": "</s>", "bos_token": "<s>"}
BUDGET = 10 ** 7


def _raise(message):
    raise jinja2.TemplateError(message)


def _reference(source: str, messages: list[dict]) -> list[tuple[int, int]] | str:
    """Each turn's (start, end) from rendering every prefix (transformers' sandbox, no meshtrain), or
    "not a prefix" when one does not begin the whole, or "refused" when the template raises."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                              extensions=["jinja2.ext.loopcontrols"])
    environment.globals["raise_exception"] = _raise
    template = environment.from_string(source)
    render = lambda part, prompt: template.render(messages=part, add_generation_prompt=prompt, **VARIABLES)
    whole, spans = render(messages, False), []
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            try:
                before, upto = render(messages[:index], True), render(messages[:index + 1], False)
            except jinja2.TemplateError:
                return "refused"
            if not (whole.startswith(before) and whole.startswith(upto)):
                return "not a prefix"
            spans.append((len(before), len(upto)))
    return spans


def _counted(monkeypatch) -> list[int]:
    """The characters of each rendering ChatTemplate streams from now on."""
    rendered, stream = [], ChatTemplate.stream

    def counting(self, *args, **kwargs):
        rendered.append(0)
        for piece in stream(self, *args, **kwargs):
            rendered[-1] += len(piece)
            yield piece

    monkeypatch.setattr(ChatTemplate, "stream", counting)
    return rendered


def _spans(template: ChatTemplate, messages: list[dict]) -> list[tuple[int, int]] | str:
    text, _ = template.render(messages, BUDGET, "x.jsonl:1", "--input")
    try:
        return [(span.start, span.end) for span in chat_turns.turn_spans(template, messages, text, BUDGET, "x.jsonl:1",
                                                                         "--input")]
    except ConfigError as err:
        if "refused it: " in str(err):
            return "refused"
        assert "does not begin the whole conversation's" in str(err), err
        return "not a prefix"


@pytest.mark.parametrize("name", TEMPLATES)
def test_each_turn_is_where_rendering_its_prefixes_puts_it(name, monkeypatch):
    template = ChatTemplate.compile(TEMPLATES[name], name, VARIABLES, "--chat-template")
    rendered = _counted(monkeypatch)
    for conversation in CONVERSATIONS.values():
        messages = [{"role": role, "content": content} for role, content in conversation]
        assert _spans(template, messages) == _reference(TEMPLATES[name], messages), (name, conversation)
    if name in ("chatml", "llama3", "qwen2.5", "deepseek-v3"):  # derived: the two traced renderings, no prefix
        messages = [{"role": role, "content": content} for role, content in CONVERSATIONS["system"]]
        rendered.clear()
        _spans(template, messages)
        assert len(rendered) == 2


def test_a_thousand_turn_chat_renders_in_characters_linear_in_its_length(monkeypatch):
    """1,000 messages (500 assistant turns): three renderings of the whole (2,000 before: 12 GB for a
    1 MB chat), and the turns where 500 turns of prefixes put them."""
    template = ChatTemplate.compile(TEMPLATES["chatml"], "chatml", VARIABLES, "--chat-template")
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " * 20} for i in range(1000)]
    rendered = _counted(monkeypatch)
    text, _ = template.render(messages, 10 ** 9, "x.jsonl:1", "--input")
    spans = chat_turns.turn_spans(template, messages, text, 10 ** 9, "x.jsonl:1", "--input")
    assert rendered == [len(text), len(text) + len("<|im_start|>assistant\n")]  # the traced two (and render())
    assert [text[span.start:span.end] for span in spans] == [m["content"] + "<|im_end|>\n" for m in messages[1::2]]
    assert text[:spans[1].start].endswith("<|im_start|>assistant\n")


def test_prefixes_that_cannot_be_derived_are_bounded_in_one_line(monkeypatch):
    """A template reading the messages' count renders each prefix; past PREFIX_RENDER_CHARACTERS the
    example is refused, naming it, the template and what to do."""
    source = "{% for m in messages %}" + TURN + "{% if messages|length < 0 %}!{% endif %}{% endfor %}"
    source += GENERATION_PROMPT
    template = ChatTemplate.compile(source, "count.jinja", VARIABLES, "--chat-template")
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"m{i}"} for i in range(40)]
    text, _ = template.render(messages, BUDGET, "x.jsonl:1", "--input")
    rendered = _counted(monkeypatch)
    assert len(chat_turns.turn_spans(template, messages, text, BUDGET, "x.jsonl:1", "--input")) == 20
    assert len(rendered) == 2 + 39  # the traced two, then every prefix but the whole conversation
    monkeypatch.setattr(chat_turns, "PREFIX_RENDER_CHARACTERS", 39 * (len(text) // 2) - 1)
    with pytest.raises(ConfigError, match=r"^--input: x.jsonl:1: its 20 assistant turns would render or compare about "
                       r"[\d,]+ characters \(more than [\d,]+\): the chat template \(count.jinja\) does not mark the "
                       r"assistant text with \{% generation %\}, and 39 of the 39 conversations before and up to a "
                       r"turn must be rendered again"):
        chat_turns.turn_spans(template, messages, text, BUDGET, "x.jsonl:1", "--input")
