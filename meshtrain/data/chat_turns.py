"""Where each assistant turn lies in a conversation's text, for a chat template that does not mark it
with ``{% generation %}``: from the end of the conversation before the turn rendered with the
generation prompt, to the end of the conversation up to and including the turn (both texts must
begin the whole conversation's; transformers' definition by prefixes).

Rendering those prefixes takes time quadratic in the turns. Instead the conversation is rendered
twice more (without and with the generation prompt) with its messages as a sequence that records
each read (``_Messages``), and each prefix's text is derived from those renderings when that is
exact. A Jinja rendering is a deterministic function of what it reads, so rendering
``messages[:m]`` does what rendering all of them did until the first read whose result differs. When
that read is a ``{% for %}`` loop (a direct one: its output written as made) asking for message m, and
that loop has had messages before, the prefix's loop ends there, and the prefix's text is the whole
one without that loop's output from message m on, provided what is read after the loop agrees: no
message at or past m, nor their count, nor a ``namespace()`` attribute the rest of the loop changed
(a ``cycler()``/``joiner()`` keeps state unseen: none may be made). Several such loops are cut
alike. A prefix that cannot be derived so (the template reads the count of the messages, looks ahead,
...) is rendered as before, and an example whose renderings and comparisons would pass
``PREFIX_RENDER_CHARACTERS`` characters is refused in one line.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from jinja2.runtime import LoopContext

from meshtrain.data.chat_template import ChatTemplate, Rendering, charged
from meshtrain.errors import ConfigError, shown

ASSISTANT = "assistant"  # the role whose messages are trained on
# The characters an example's prefixes may render or compare (those not derived cost about half the
# conversation each); past it the example is refused.
PREFIX_RENDER_CHARACTERS = 1 << 30
_HEAD, _END, _READ, _WHOLE = range(4)  # what an event is (see Trace)
_LOOP_NEXT = LoopContext.__next__.__code__  # a loop advancing (its loop.last / loop.length peek ahead instead)
_BEFORE = "the conversation before it with the generation prompt"
_UPTO = "the conversation up to its end"


class Span(NamedTuple):
    """Characters ``[start, end)`` of an example's text that the loss is on. label: what it is in
    errors ("assistant turn 2"); before, upto: what the text up to its start and its end is."""

    label: str
    start: int
    end: int
    before: str
    upto: str


class _Event(NamedTuple):
    kind: int  # _HEAD: a direct loop advanced to message index; _END: it found no more (index: the count);
    # _READ: message index read otherwise; _WHOLE: the count of the messages, or all of them, read
    index: int
    loop: int  # the loop's number (_HEAD, _END)
    position: int  # characters written before it (_HEAD, _END)
    first: bool  # the loop's first message (_HEAD)


class Trace:
    """What one rendering read of its messages and namespaces, in order (a ``chat_template.Tracer``)."""

    def __init__(self, messages: list[dict]):
        self.messages = messages
        self.events: list[_Event] = []
        self.loops = 0
        self.ends: dict[int, int] = {}  # loop number -> the event of its _END
        self.writes: dict[tuple[int, str], tuple[list[int], list[Any]]] = {}  # (namespace, name) -> events, values
        self.names: dict[int, set[str]] = {}  # namespace -> its attributes written
        self.read_at: list[int] = []  # the events before each namespace read
        self.read_keys: list[tuple[int, str | None]] = []  # its (namespace, name or None: all of them)
        self.read_after: dict[int, set[tuple[int, str]]] = {}  # event -> the attributes read after it
        self.kept: list[Any] = []  # the namespaces (their ids stay theirs)
        self.is_stateful = False

    def read(self, index: int) -> None:
        self.events.append(_Event(_READ, index, -1, -1, False))

    def whole(self) -> None:
        self.events.append(_Event(_WHOLE, len(self.messages), -1, -1, False))

    def loop(self, iterable: Iterable, direct: bool, rendering: Rendering) -> Iterator:
        if isinstance(iterable, _Messages) and iterable.trace is self and direct:
            return self._direct_loop(iterable.start, rendering)
        return charged(iterable, rendering)

    def _direct_loop(self, start: int, rendering: Rendering) -> Iterator:
        """The messages from ``start`` on, each request by the loop itself (not a peek ahead) an event."""
        number, index = self.loops, start
        self.loops += 1
        while True:
            caller = sys._getframe(1).f_code  # who asked: the loop, or loop.last/length peeking ahead
            advancing = caller is _LOOP_NEXT or caller.co_filename == "<template>"
            if index >= len(self.messages):
                if advancing:
                    self.ends[number] = len(self.events)
                self.events.append(_Event(_END if advancing else _WHOLE, index, number, rendering.written, False))
                return
            self.events.append(_Event(_HEAD if advancing else _READ, index, number, rendering.written,
                                      index == start))
            rendering.charge(1)
            yield self.messages[index]
            index += 1

    def namespace_write(self, namespace: Any, name: str, value: Any) -> None:
        if not any(kept is namespace for kept in self.kept[-1:]):
            self.kept.append(namespace)
        events, values = self.writes.setdefault((id(namespace), name), ([], []))
        events.append(len(self.events))
        values.append(value)
        self.names.setdefault(id(namespace), set()).add(name)

    def namespace_read(self, namespace: Any, name: str | None) -> None:
        self.read_at.append(len(self.events))
        self.read_keys.append((id(namespace), name))

    def stateful(self) -> None:
        self.is_stateful = True

    def _value(self, key: tuple[int, str], event: int) -> Any:
        """The value of a namespace attribute when ``event`` happened (``_MISSING`` before it was set)."""
        events, values = self.writes.get(key, ((), ()))
        at = bisect.bisect_right(events, event)
        return values[at - 1] if at else _MISSING

    def agrees(self, cut: int, end: int) -> bool:
        """Whether every namespace attribute read after event ``end`` had the value at event ``cut``
        it has at ``end`` (same type and value for str, int, bool and None; else the same object)."""
        if end not in self.read_after:
            later = self.read_keys[bisect.bisect_right(self.read_at, end):]
            self.read_after[end] = {(namespace, each) for namespace, name in later
                                    for each in ([name] if name is not None else self.names.get(namespace, ()))}
        keys = self.read_after[end]
        return all(_same(self._value(key, cut), self._value(key, end)) for key in keys)


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and type(a) in (str, int, bool, type(None)) and a == b)


class _Messages:
    """The messages as a traced rendering reads them (from ``start``: ``messages[1:]`` is one too):
    the same values as a list, each read told to the trace with the messages it depends on."""

    __hash__ = None  # as a list's

    def __init__(self, trace: Trace, start: int = 0):
        self.trace, self.start = trace, start

    def _list(self) -> list[dict]:
        self.trace.whole()
        return self.trace.messages[self.start:]

    def __getitem__(self, key):
        if isinstance(key, slice) and key.stop is None and key.step in (None, 1) \
                and (key.start is None or (isinstance(key.start, int) and key.start >= 0)):
            return _Messages(self.trace, self.start + (key.start or 0))
        if isinstance(key, int) and key >= 0:
            self.trace.read(self.start + key)
            return self.trace.messages[self.start + key]
        return self._list()[key]

    def __bool__(self) -> bool:
        self.trace.read(self.start)
        return len(self.trace.messages) > self.start

    def __iter__(self) -> Iterator[dict]:
        index = self.start
        while index < len(self.trace.messages):
            self.trace.read(index)
            yield self.trace.messages[index]
            index += 1
        self.trace.whole()

    def __len__(self) -> int:
        return len(self._list())

    def __reversed__(self) -> Iterator[dict]:
        return reversed(self._list())

    def __contains__(self, value: Any) -> bool:
        return value in self._list()

    def __eq__(self, other: Any) -> bool:
        return self._list() == (other._list() if isinstance(other, _Messages) else other)

    def __ne__(self, other: Any) -> bool:
        return not self == other

    def __add__(self, other: Any) -> list:
        return self._list() + (other._list() if isinstance(other, _Messages) else other)

    def __radd__(self, other: Any) -> list:
        return other + self._list()

    def __mul__(self, count: Any) -> list:
        return self._list() * count

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return repr(self._list())

    def __getattr__(self, name: str) -> Any:
        if name in ("index", "count", "copy"):  # a list's methods that change nothing
            return getattr(self._list(), name)
        raise AttributeError(name)


class _FirstAtLeast:
    """``find(i, m)``: the first index k >= i of ``values`` with values[k] >= m (len when none), in
    O(log n) (a sparse table of maxima)."""

    def __init__(self, values: list[int]):
        self.levels, width = [values], 1
        while 2 * width <= len(values):
            below = self.levels[-1]
            self.levels.append([max(below[i], below[i + width]) for i in range(len(below) - width)])
            width *= 2

    def find(self, start: int, at_least: int) -> int:
        k = start
        for level in range(len(self.levels) - 1, -1, -1):
            if k + (1 << level) <= len(self.levels[0]) and self.levels[level][k] < at_least:
                k += 1 << level
        return k


class _Traced(NamedTuple):
    """A rendering of the whole conversation with its trace, and what finds its reads."""

    text: str
    trace: Trace
    divergent: _FirstAtLeast  # over the events: the fewest messages a prefix needs to read each alike

    def pieces(self, count: int) -> list[tuple[int, int]] | None:
        """The characters ``[a, b)`` of ``text`` that rendering the first ``count`` messages writes,
        in order; None when that cannot be derived (module docstring)."""
        events, trace = self.trace.events, self.trace
        if trace.is_stateful:
            return None
        pieces, at, k = [], 0, self.divergent.find(0, count)
        while k < len(events):
            event = events[k]
            end = trace.ends.get(event.loop)
            if event.kind != _HEAD or event.index != count or event.first or end is None or not trace.agrees(k, end):
                return None
            pieces.append((at, event.position))
            at, k = events[end].position, self.divergent.find(end + 1, count)
        return [*pieces, (at, len(self.text))]


def _traced(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool, budget: int, where: str,
            field: str) -> _Traced:
    trace = Trace(messages)
    text = "".join(template.stream(_Messages(trace), add_generation_prompt, budget, where, field, trace))
    reads = [len(messages) if e.kind == _WHOLE else e.index for e in trace.events]  # _END's index: the count
    return _Traced(text, trace, _FirstAtLeast(reads))


def _common_prefix(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` begin with alike."""
    at, size = 0, min(len(a), len(b))
    while at < size and a[at:at + 4096] == b[at:at + 4096]:
        at += 4096
    while at < size and a[at] == b[at]:
        at += 1
    return min(at, size)


def turn_spans(template: ChatTemplate, messages: list[dict], text: str, budget: int, where: str,
               field: str) -> list[Span]:
    """Each assistant turn's span of ``text`` (the conversation rendered without the generation
    prompt): a one-line ``ConfigError(field)`` naming ``where`` when a prefix's text does not begin
    ``text``, or when the prefixes not derived would render too much."""
    turns = [index for index, message in enumerate(messages) if message["role"] == ASSISTANT]
    wanted = [(index, True) for index in turns] + [(index + 1, False) for index in turns if index + 1 < len(messages)]
    derived: dict[tuple[int, bool], list[tuple[int, int]] | None] = dict.fromkeys(wanted)
    renderings = {}
    try:
        renderings = {prompt: _traced(template, messages, prompt, budget, where, field) for prompt in (False, True)}
    except ConfigError:  # the recording sequence is not a list (json of it, say): every prefix is rendered
        pass
    if renderings and renderings[False].text == text:
        derived = {(count, prompt): renderings[prompt].pieces(count) for count, prompt in wanted}
    cost = sum(b - a for pieces in derived.values() if pieces for a, b in pieces[1:])
    cost += sum(len(text) // 2 for pieces in derived.values() if pieces is None)
    if cost > PREFIX_RENDER_CHARACTERS:
        rendered = sum(pieces is None for pieces in derived.values())
        raise ConfigError(field, f"{where}: its {len(turns):,} assistant turns would render or compare about {cost:,} "
                          f"characters (more than {PREFIX_RENDER_CHARACTERS:,}): the chat template "
                          f"({template.source}) does not mark the assistant text with {{% generation %}}, and "
                          f"{rendered:,} of the {len(wanted):,} conversations before and up to a turn must be rendered "
                          "again (it reads the count of the messages or looks ahead); mark it (rendered once), or "
                          "split the conversation")
    common = _common_prefix(renderings[True].text, text) if renderings else 0
    spans = []
    for number, index in enumerate(turns, 1):
        label = f"assistant turn {number}"
        ends = []
        for count, prompt, what in ((index, True, _BEFORE), (index + 1, False, _UPTO)):
            if count == len(messages):
                ends.append(len(text))
            elif derived[count, prompt] is None:
                ends.append(_prefix_end(template, messages[:count], prompt, text, budget, where, field, label, what))
            else:
                alike = common if prompt else len(text)
                ends.append(_derived_end(renderings[prompt].text, derived[count, prompt], alike, text, where, field,
                                         label, what))
        spans.append(Span(label, *ends, _BEFORE, _UPTO))
    return spans


def _not_a_prefix(at: int, has: str, whole: str, where: str, field: str, label: str, what: str) -> ConfigError:
    return ConfigError(field, f"{where}: {label}: the text of {what} does not begin the whole conversation's (at "
                       f"character {at:,} it has {shown(has[:20])}, the whole {shown(whole[at:at + 20])}): the chat "
                       "template renders the messages before the last differently once more follow; mark the "
                       "assistant text with {% generation %}, or change the template")


def _derived_end(rendered: str, pieces: list[tuple[int, int]], alike: int, whole: str, where: str, field: str,
                 label: str, what: str) -> int:
    """How many characters of ``whole`` the prefix made of ``pieces`` of ``rendered`` is, which it
    must begin (``alike``: the characters ``rendered`` and ``whole`` begin with alike)."""
    first = pieces[0][1]
    if first > alike:
        raise _not_a_prefix(alike, rendered[alike:first], whole, where, field, label, what)
    at = first
    for a, b in pieces[1:]:
        if not whole.startswith(rendered[a:b], at):
            differ = _common_prefix(rendered[a:b], whole[at:at + b - a])
            raise _not_a_prefix(at + differ, rendered[a + differ:b], whole, where, field, label, what)
        at += b - a
    return at


def _prefix_end(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool, whole: str, budget: int,
                where: str, field: str, label: str, what: str) -> int:
    """How many characters of ``whole`` the rendering of ``messages`` is, which it must begin."""
    at = 0
    for piece in template.stream(messages, add_generation_prompt, budget, where, field):
        if not whole.startswith(piece, at):
            differ = _common_prefix(piece, whole[at:at + len(piece)])
            raise _not_a_prefix(at + differ, piece[differ:], whole, where, field, label, what)
        at += len(piece)
    return at
