"""Chat templates rendered safely (``meshtrain.data.sft``'s templates: the tokenizer's own, a file, or
the built-in default): jinja2's immutable sandbox with no loader (no include / extends / import), a
deterministic step budget per example (loop iterations, calls, filters, operators and the size of
what each makes), bounded integers and output, and every failure one ``ConfigError`` line naming the
template's source, the example and the template's line. ``{% generation %}`` marks the text the loss
is on (as transformers' ``return_assistant_tokens_mask``). A rendering may be traced (``Tracer``,
``meshtrain.data.chat_turns``): told of each ``{% for %}`` loop, the loops whose output is written as
made (not collected by a macro, block or ``{% set %}``/``{% filter %}``/``{% call %}`` block), and of
what ``namespace()`` objects and ``cycler()``/``joiner()`` keep.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from meshtrain.data.tokenizer import MAX_PIECE_CHARS
from meshtrain.errors import ConfigError, cut

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # in a tokenizer directory (transformers >= 4.43) and a prepared one

MAX_INT_BITS = 1 << 16  # the largest integer a template's * or ** may make
CHARGED_FILTER = "_charged"  # the filter that charges what a {% set %} block makes

# The built-in template: Alpaca-style headers; each response ends with EOS (so a generation stops),
# its text marked with {% generation %}. A blank line goes before each message but the first, never
# after a response, so the response's tokens (its content and EOS) are all the loss is on.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if not loop.first %}{{ '\\n\\n' }}{% endif -%}\n"
    "{%- if message['role'] == 'system' -%}{{ message['content'] }}\n"
    "{%- elif message['role'] == 'user' -%}{{ '### Instruction:\\n' + message['content'] }}\n"
    "{%- elif message['role'] == 'assistant' -%}{{ '### Response:\\n' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}\n"
    "{%- else -%}{{ raise_exception('the built-in chat template knows the roles system, user and assistant, "
    "not ' + message['role']) }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '\\n\\n### Response:\\n' if messages else '### Response:\\n' }}{%- endif -%}\n")


class Tracer(Protocol):
    """What a traced rendering tells (``meshtrain.data.chat_turns.Trace``)."""

    def loop(self, iterable: Iterable, direct: bool, rendering: Rendering) -> Iterator:
        """The items a ``{% for %}`` loop over ``iterable`` gets (each charged one step); ``direct``:
        the loop's output is written as it is made."""

    def namespace_write(self, namespace: Any, name: str, value: Any) -> None:
        """An attribute of a ``namespace()`` set (also each one it is made with)."""

    def namespace_read(self, namespace: Any, name: str | None) -> None:
        """An attribute of a ``namespace()`` read (``None``: all of them, as its text)."""

    def stateful(self) -> None:
        """A ``cycler()`` or ``joiner()`` was made: state that outlives a loop, and is not seen."""


class Rendering:
    """One rendering in progress: the steps it took of its budget, the characters it wrote so far,
    where each ``{% generation %}`` block's text went (``(start, text)``) and what traces it."""

    def __init__(self, budget: int, tracer: Tracer | None = None):
        self.budget, self.steps, self.written, self.tracer = budget, 0, 0, tracer
        self.generated: list[tuple[int, str]] = []

    def charge(self, steps: int) -> None:
        self.steps += steps
        if self.steps > self.budget:
            raise SecurityError(f"it took more than {self.budget:,} steps (loop iterations, calls and the characters "
                                "they make), the most its rendering may take: a loop or a recursion without end?")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' marker of assistant text): renders
    its body and notes where that text goes."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        text = caller()
        rendering = self.environment.rendering
        rendering.generated.append((rendering.written, text))
        return text


class _Steps(jinja2.ext.Extension):
    """Steps that Jinja's own code would not charge: each ``{% for %}`` iteration (``iterate``) and
    each ``~`` (``concat``, a call: charged as one). ``_Charging`` puts them in a template."""

    def iterate(self, iterable: Iterable, direct: bool) -> Iterator:
        rendering = self.environment.rendering
        if rendering.tracer is not None:
            return rendering.tracer.loop(iterable, direct, rendering)
        return charged(iterable, rendering)

    @staticmethod
    def concat(*parts) -> str:
        return "".join(map(str, parts))


def charged(iterable: Iterable, rendering: Rendering) -> Iterator:
    """``iterable``'s items, each charged one step of ``rendering``."""
    for item in iterable:
        rendering.charge(1)
        yield item


class _Charging(jinja2.visitor.NodeTransformer):
    """Rewrites a parsed template so that all it does is charged: each loop's iterable wrapped in
    ``_Steps.iterate`` (told whether the loop is direct: outside every macro, block, ``{% call %}``,
    ``{% filter %}`` and ``{% set %}`` block, which collect their output before it is written), each
    ``~`` made a call of ``_Steps.concat`` and each ``{% set %}`` block given the filter
    ``CHARGED_FILTER`` (a filter is charged for what it returns)."""

    def __init__(self, steps: _Steps):
        self.steps, self.collecting = steps, 0

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        direct = jinja2.nodes.Const(self.collecting == 0, lineno=node.lineno)
        node = self.generic_visit(node)
        node.iter = self.steps.call_method("iterate", [node.iter, direct], lineno=node.lineno)
        return node

    def _collected(self, node: jinja2.nodes.Node) -> jinja2.nodes.Node:
        self.collecting += 1
        try:
            return self.generic_visit(node)
        finally:
            self.collecting -= 1

    visit_Macro = visit_CallBlock = visit_FilterBlock = visit_Block = _collected

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        return self.steps.call_method("concat", node.nodes, lineno=node.lineno)

    def visit_AssignBlock(self, node: jinja2.nodes.AssignBlock) -> jinja2.nodes.Node:
        node = self._collected(node)
        if node.filter is None:
            node.filter = jinja2.nodes.Filter(None, CHARGED_FILTER, [], [], None, None, lineno=node.lineno)
        return node


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' ``tojson`` (Jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _size(value) -> int:
    """The length of a string, list, tuple, dict or range a template made, else 0."""
    return len(value) if isinstance(value, (str, list, tuple, dict, range)) else 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_numbers(args: tuple, kwargs: dict) -> None:
    """Refuses a call given a number larger than any string a rendering may write (a width, a
    repeat count: what it would make could not be held)."""
    for value in (*args, *kwargs.values()):
        if _is_int(value) and abs(value) > MAX_PIECE_CHARS:
            raise SecurityError(f"a call was given the number {value:,}, more than the {MAX_PIECE_CHARS:,} "
                                "characters a rendering may write")


def _check_binop(operator: str, left, right) -> None:
    """Refuses a ``+``, ``*`` or ``**`` whose string, list or integer would be too large to make."""
    sequences = [value for value in (left, right) if isinstance(value, (str, list, tuple))]
    numbers = [value for value in (left, right) if _is_int(value)]
    size = bits = 0
    if operator == "+" and len(sequences) == 2:
        size = len(left) + len(right)
    elif operator == "*" and len(sequences) == 1 and len(numbers) == 1:
        size = len(sequences[0]) * numbers[0]
    elif operator == "*" and len(numbers) == 2:
        bits = left.bit_length() + right.bit_length()
    elif operator == "**" and len(numbers) == 2 and right > 0 and abs(left) > 1:
        bits = right * left.bit_length()
    if size > MAX_PIECE_CHARS:
        raise SecurityError(f"{operator} would make a string or list of {size:,} items, more than the "
                            f"{MAX_PIECE_CHARS:,} characters a rendering may write")
    if bits > MAX_INT_BITS:
        raise SecurityError(f"{operator} would make an integer of about {bits:,} bits, more than {MAX_INT_BITS:,}")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()``, telling a traced rendering's tracer of its writes and reads."""

    def __init__(self, tracer: Tracer | None, /, *args, **kwargs):
        object.__setattr__(self, "_tracer", tracer)
        super().__init__(*args, **kwargs)
        if tracer is not None:
            for name, value in object.__getattribute__(self, "_Namespace__attrs").items():
                tracer.namespace_write(self, name, value)

    def __getattribute__(self, name: str) -> Any:
        if name == "_tracer":
            return object.__getattribute__(self, name)
        if name not in ("_Namespace__attrs", "__class__") and self._tracer is not None:
            self._tracer.namespace_read(self, name)
        return super().__getattribute__(name)

    def __setitem__(self, name: str, value: Any) -> None:
        if self._tracer is not None:
            self._tracer.namespace_write(self, name, value)
        super().__setitem__(name, value)

    def __repr__(self) -> str:
        if self._tracer is not None:
            self._tracer.namespace_read(self, None)
        return super().__repr__()


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, every rendering of which is bounded: each loop iteration, call,
    filter, ``~``, ``{% set %}`` block and ``+``/``*``/``**``/``%`` costs a step plus the length of
    the string or list it makes (``_Charging`` makes the first ones charged), up to
    the rendering's budget (``Rendering``); a string or list longer than ``MAX_PIECE_CHARS``, an
    integer beyond ``MAX_INT_BITS`` bits, or a call given a number beyond ``MAX_PIECE_CHARS`` is
    refused before it is made. No loader (a template includes, extends and imports nothing)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, _Steps, jinja2.ext.loopcontrols])
        self.rendering: Rendering | None = None  # set by ChatTemplate around each step of a rendering
        self.globals["namespace"] = lambda *args, **kwargs: _Namespace(self.rendering.tracer, *args, **kwargs)
        self.globals["cycler"] = self._stateful(jinja2.utils.Cycler)
        self.globals["joiner"] = self._stateful(jinja2.utils.Joiner)
        self.filters["tojson"] = _tojson
        self.filters[CHARGED_FILTER] = lambda text: text
        self.filters = {name: self._bounded(function) for name, function in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        del self.globals["lipsum"]  # its paragraph count makes unbounded text

    def _stateful(self, make):
        def made(*args, **kwargs):
            if self.rendering.tracer is not None:
                self.rendering.tracer.stateful()
            return make(*args, **kwargs)
        return made

    def _charged(self, result):
        self.rendering.charge(1 + _size(result))
        return result

    def _bounded(self, function):
        @functools.wraps(function)  # keeps Jinja's pass_context marks
        def bounded(*args, **kwargs):
            _check_numbers(args, kwargs)
            return self._charged(function(*args, **kwargs))
        return bounded

    def call(self, context, function, /, *args, **kwargs):
        _check_numbers(args, kwargs)
        return self._charged(super().call(context, function, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right)
        return self._charged(super().call_binop(context, operator, left, right))


def _template_line(error: BaseException) -> str:
    """`` (its line N)``: the template line ``error`` was raised at, from Jinja's rewritten traceback."""
    line, frame = None, error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == "<template>":
            line = frame.tb_lineno
        frame = frame.tb_next
    return f" (its line {line})" if line else ""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template, compiled. text: its Jinja source; source: where it came from (a path, or
    ``DEFAULT_TEMPLATE_SOURCE``); variables: the special tokens it sees (``bos_token``, ...); uses:
    the variables it reads; marks_generation: whether it has ``{% generation %}`` blocks."""

    text: str
    source: str
    variables: dict[str, str]
    uses: frozenset[str]
    marks_generation: bool
    template: jinja2.Template = dataclasses.field(repr=False, compare=False)

    @classmethod
    def compile(cls, text: str, source: str, variables: dict[str, str], field: str) -> ChatTemplate:
        environment = _BoundedSandbox()
        try:
            tree = environment.parse(text)
        except jinja2.TemplateSyntaxError as err:
            raise ConfigError(field, f"the chat template of {source} is not valid Jinja (its line {err.lineno}: "
                              f"{err.message})") from None
        loading = next(tree.find_all((jinja2.nodes.Extends, jinja2.nodes.Include, jinja2.nodes.Import,
                                      jinja2.nodes.FromImport)), None)
        if loading is not None:
            tag = {jinja2.nodes.FromImport: "from ... import"}.get(type(loading), type(loading).__name__.lower())
            raise ConfigError(field, f"the chat template of {source} uses {{% {tag} %}} (its line {loading.lineno}); "
                              "a chat template is one file that loads no other: write what it would load into it")
        uses = frozenset(jinja2.meta.find_undeclared_variables(tree))
        marks_generation = any(isinstance(block.call.node, jinja2.nodes.ExtensionAttribute)
                               and block.call.node.identifier == _GenerationTag.identifier
                               for block in tree.find_all(jinja2.nodes.CallBlock))
        _Charging(environment.extensions[_Steps.identifier]).visit(tree)
        return cls(text, source, dict(variables), uses, marks_generation, environment.from_string(tree))

    def stream(self, messages: list[dict], add_generation_prompt: bool, budget: int, where: str,
               field: str, tracer: Tracer | None = None) -> Iterator[str]:
        """The conversation's text, in the pieces Jinja writes it, within ``budget`` steps and
        ``MAX_PIECE_CHARS`` characters (traced by ``tracer``: ``messages`` may be its sequence);
        whatever stops it is a one-line ``ConfigError(field)`` naming ``where`` (the example), the
        template and the template's line."""
        return self._stream(messages, add_generation_prompt, Rendering(budget, tracer), where, field)

    def render(self, messages: list[dict], budget: int, where: str, field: str) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text (as ``stream`` writes it, without the generation prompt) and the
        characters ``[start, end)`` of each non-empty ``{% generation %}`` block's text in it."""
        rendering = Rendering(budget)
        text = "".join(self._stream(messages, False, rendering, where, field))
        spans = []
        for number, (start, generated) in enumerate(rendering.generated, 1):
            if text[start:start + len(generated)] != generated:
                raise ConfigError(field, f"{where}: the chat template ({self.source}) writes its {{% generation %}} "
                                  f"block {number} through a macro, {{% set %}} or filter block, so where its text "
                                  "lands cannot be told; put {% generation %} where the text is written")
            if generated:
                spans.append((start, start + len(generated)))
        return text, spans

    def _stream(self, messages: list[dict], add_generation_prompt: bool, rendering: Rendering, where: str,
                field: str) -> Iterator[str]:
        pieces = self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.variables)
        failed = f"{where}: the chat template ({self.source})"
        environment = self.template.environment
        while True:
            environment.rendering = rendering  # the account this step of this rendering charges
            try:
                piece = next(pieces)
            except StopIteration:
                return
            except jinja2.TemplateError as err:
                raise ConfigError(field, f"{failed} refused it: {cut(str(err), 200)}{_template_line(err)}") from None
            except RecursionError as err:
                raise ConfigError(field, f"{failed} recursed too deeply on it{_template_line(err)}: a macro that "
                                  "calls itself without end?") from None
            except MemoryError as err:
                raise ConfigError(field, f"{failed} ran out of memory on it{_template_line(err)}: it builds a "
                                  "string or list too large") from None
            except Exception as err:  # noqa: BLE001 - a template is a program: what it raises is its own fault
                raise ConfigError(field, f"{failed} failed on it{_template_line(err)}: {type(err).__name__}: "
                                  f"{cut(str(err), 200)}") from None
            finally:
                environment.rendering = None
            rendering.written += len(piece)
            if rendering.written > MAX_PIECE_CHARS:
                raise ConfigError(field, f"{failed} renders it to more than {MAX_PIECE_CHARS:,} characters, the "
                                  "most tokenized at once; shorten it")
            yield piece
