"""Pipeline schedules as data: which operation each stage runs at each tick.

A ``ScheduleTable`` is a list of ticks; a tick is a short sequence of slots, each slot one kind of
work (``F`` forward, ``B`` backward, ``I`` input-gradient half of a backward, ``W`` its
weight-gradient half) with, per stage, the task it runs there (``(microbatch, chunk)``) or nothing.
Stage s holds ``chunks`` (virtual stages) of layers; its local chunk v is logical chunk ``v*S + s``,
so a microbatch goes round the ring of stages ``chunks`` times. One SPMD executor
(``meshtrain.parallel.executor``) runs any valid table in lock step: within a tick every stage runs
its task of each slot (or idles), the head follows the forward slot whose last stage finishes a
microbatch, and activations (gradients) move one stage forward (back) between ticks.

In lock step a tick lasts as long as its slots: the time of a table is the sum over ticks of the
cost of each slot kind present in it, and its bubble is the share of that time a stage idles
(``ScheduleTable.bubble``). With costs F = 1, B = 2 = I + W, for S stages, M microbatches and V
chunks:

* GPipe: all forwards, then all backwards; bubble (S-1)/(M+S-1); holds all M microbatches.
* 1F1B: F at tick m+s, B at tick m+2S-2-s; bubble (S-1)/(M+S-1) (Megatron's); holds at most
  2S-1 microbatches on stage 0 (lock step: stage 0 keeps forwarding while the first backward
  travels), flat in M.
* Interleaved 1F1B (Megatron's virtual pipeline; M a multiple of S): microbatches in groups of S
  walk the V chunks; bubble (S-1)/(VM+S-1); at most 2VS-1 chunk activations (~2S microbatches).
* ZB-H1 (Qi et al., 2023): 1F1B with B split into I (on the critical path) and W, every W(m) at
  tick m+2S-2, so only M ticks carry a W slot: time (M+S-1)(F+I) + M W, bubble
  2(S-1)/(3M+2(S-1)); the same peak as 1F1B. (Asynchronous stages also overlap the F of one stage
  with the I of another; lock step cannot, so its bubble is (S-1)(F+I), not the paper's (S-1)(F+I-W).)

A user table (``pipeline.schedule: custom``, ``pipeline.table: file.json``) is checked here: every
task runs once, after what it needs (the previous chunk's forward one tick earlier, the next chunk's
input gradient one tick earlier, the head for the last chunk, its own forward, and I before W).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from collections.abc import Callable, Iterable

import jax
import numpy as np

from meshtrain import jsonio
from meshtrain.errors import ConfigError


class Work(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    INPUT_GRAD = "I"
    WEIGHT_GRAD = "W"


# Work that produces the gradient a stage sends to the previous one.
SENDS_GRADIENT = (Work.BACKWARD, Work.INPUT_GRAD)


@dataclasses.dataclass(frozen=True)
class Task:
    """One stage's part of a slot: ``microbatch`` on its stage-local ``chunk``."""

    microbatch: int
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class Slot:
    """One kind of ``work`` and, per stage, the task it runs (None: idle)."""

    work: Work
    tasks: tuple[Task | None, ...]


@dataclasses.dataclass(frozen=True)
class OpCosts:
    """Relative cost of each kind of work on one stage's full set of layers (a chunk costs 1/V of
    it) and of the head on one microbatch (split over the stages)."""

    forward: float = 1.0
    backward: float = 2.0
    input_grad: float = 1.0
    weight_grad: float = 1.0
    head: float = 0.0

    def of(self, work: Work) -> float:
        return {Work.FORWARD: self.forward, Work.BACKWARD: self.backward, Work.INPUT_GRAD: self.input_grad,
                Work.WEIGHT_GRAD: self.weight_grad}[work]


@dataclasses.dataclass(frozen=True)
class Buffers:
    """How many slots each per-stage buffer of the executor has (the table's peak of live entries):
    ``inputs`` (activations received, awaiting their forward), ``gradients`` (cotangents received
    or made by the head, awaiting their backward), ``stash`` (what a forward keeps for its
    backward), ``cut`` (what an input-gradient half keeps for its weight-gradient half)."""

    inputs: int
    gradients: int
    stash: int
    cut: int


# The columns of ``ScheduleTable.buffers``: per kind of work, [ticks, stages] int32 arrays, -1 where
# a stage runs no such task. Pytrees, so the executor scans and indexes them as they are.
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tasks:
    """The task of each (tick, stage): its ``microbatch`` and stage-local ``chunk``."""

    microbatch: np.ndarray
    chunk: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardTasks(Tasks):
    """A forward reads its ``input`` slot (-1 for the first chunk: it embeds) and stores its
    ``stash`` slot."""

    input: np.ndarray
    stash: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BackwardTasks(Tasks):
    """A backward (or its input-gradient half) reads its output's ``gradient`` slot and its
    forward's ``stash`` slot (a whole backward releases it)."""

    gradient: np.ndarray
    stash: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InputGradTasks(BackwardTasks):
    """An input-gradient half also stores what its weight-gradient half needs in its ``cut`` slot."""

    cut: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WeightGradTasks(Tasks):
    """A weight-gradient half reads (and releases) its forward's ``stash`` and its input-gradient
    half's ``cut`` slot."""

    stash: np.ndarray
    cut: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Columns:
    """Every column of a table: the tasks of each kind of work; ``receive_input`` /
    ``receive_gradient``, where what arrives at the tick's end goes; ``head_gradient``, on the last
    stage, where the head's output gradient goes."""

    forward: ForwardTasks
    backward: BackwardTasks
    input_grad: InputGradTasks
    weight_grad: WeightGradTasks
    receive_input: np.ndarray
    receive_gradient: np.ndarray
    head_gradient: np.ndarray

    def of(self, work: Work) -> Tasks:
        """The tasks of ``work``."""
        return {Work.FORWARD: self.forward, Work.BACKWARD: self.backward, Work.INPUT_GRAD: self.input_grad,
                Work.WEIGHT_GRAD: self.weight_grad}[work]


def _kept(method: Callable) -> Callable:
    """A method of the (frozen, immutable) table whose result for its arguments is kept on the
    instance: the planner asks thousands of candidate layouts the same questions of a few tables
    (``gpipe`` and the other builders return one table per shape). Arrays in it are read-only."""

    @functools.wraps(method)
    def kept(self, *args):
        memo = self.__dict__.setdefault("_kept", {})
        key = (method.__name__, args)
        if key not in memo:
            result = method(self, *args)
            for leaf in jax.tree.leaves(result):
                if isinstance(leaf, np.ndarray):
                    leaf.setflags(write=False)
            memo[key] = tuple(result) if isinstance(result, list) else result
        result = memo[key]
        return list(result) if method.__name__ == "problems" else result

    return kept


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    stages: int
    chunks: int
    microbatches: int
    ticks: tuple[tuple[Slot, ...], ...]

    # ----- structure -----
    def logical_chunk(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    @property
    def last_chunk(self) -> int:
        return self.stages * self.chunks - 1

    def head_microbatch(self, tick: int) -> int | None:
        """The microbatch whose head runs in ``tick`` (after its forward slot), if any."""
        for slot in self.ticks[tick]:
            task = slot.tasks[-1] if slot.work is Work.FORWARD else None
            if task is not None and task.chunk == self.chunks - 1:
                return task.microbatch
        return None

    def signature(self, tick: int) -> tuple[tuple[Work, ...], bool]:
        """The slot kinds of ``tick`` and whether a head runs in it: ticks with equal signatures
        compile to one loop body."""
        return tuple(slot.work for slot in self.ticks[tick]), self.head_microbatch(tick) is not None

    def forward_only(self) -> ScheduleTable:
        """The forwards alone (evaluation): ticks without a forward slot dropped."""
        ticks = tuple(tuple(s for s in tick if s.work is Work.FORWARD) for tick in self.ticks)
        return dataclasses.replace(self, ticks=tuple(t for t in ticks if t))

    @property
    def splits_backward(self) -> bool:
        return any(slot.work is Work.INPUT_GRAD for tick in self.ticks for slot in tick)

    # ----- cost -----
    @_kept
    def time(self, costs: OpCosts = OpCosts()) -> float:
        """Lock-step time: per tick, the cost of each slot kind present (a chunk is 1/V of a
        stage's layers) plus the head's share (1/S of it) when one runs."""
        total = 0.0
        for tick in range(len(self.ticks)):
            works, head = self.signature(tick)
            total += sum(costs.of(w) for w in works) / self.chunks + (costs.head / self.stages if head else 0.0)
        return total

    def bubble(self, costs: OpCosts = OpCosts()) -> float:
        """Share of the lock-step time a stage idles: 1 - its work / the table's time."""
        work = self.microbatches * (costs.forward + costs.backward + costs.head / self.stages)
        return 1.0 - work / self.time(costs)

    # ----- memory -----
    @_kept
    def in_flight(self) -> np.ndarray:
        """[stages] peak count of (microbatch, chunk) forwards whose stash is still held (from the
        forward until its backward, or its weight-gradient half)."""
        peaks = np.zeros(self.stages, int)
        live = np.zeros(self.stages, int)
        for tick in self.ticks:
            for slot in tick:
                for stage, task in enumerate(slot.tasks):
                    if task is None:
                        continue
                    if slot.work is Work.FORWARD:
                        live[stage] += 1
                        peaks[stage] = max(peaks[stage], live[stage])
                    elif slot.work in (Work.BACKWARD, Work.WEIGHT_GRAD):
                        live[stage] -= 1
        return peaks

    @property
    def peak_in_flight(self) -> int:
        """The most chunk activations any stage holds at once (the stash every stage allocates)."""
        return int(self.in_flight().max())

    def describe(self) -> str:
        return (f"{len(self.ticks)} ticks, bubble {self.bubble():.1%} (F=1, B=2, I=W=1), peak "
                f"{self.peak_in_flight} chunk activations in flight "
                f"({self.peak_in_flight / self.chunks:g} microbatches' worth of a stage)")

    # ----- checks -----
    @_kept
    def problems(self) -> list[str]:
        """Why the table cannot run (empty when it can)."""
        found = []
        done: dict[tuple[Work, int, int], tuple[int, int]] = {}  # (work, microbatch, logical) -> (tick, slot)
        head_at: dict[int, tuple[int, int]] = {}
        for t, tick in enumerate(self.ticks):
            kinds = [slot.work for slot in tick]
            if len(set(kinds)) != len(kinds):
                found.append(f"tick {t} has two slots of the same kind {kinds}")
            if sum(k in SENDS_GRADIENT for k in kinds) > 1:
                found.append(f"tick {t} has both a B and an I slot")
            for k, slot in enumerate(tick):
                if len(slot.tasks) != self.stages:
                    found.append(f"tick {t} slot {k} names {len(slot.tasks)} stages, not {self.stages}")
                    continue
                for stage, task in enumerate(slot.tasks):
                    if task is None:
                        continue
                    if not (0 <= task.microbatch < self.microbatches and 0 <= task.chunk < self.chunks):
                        found.append(f"tick {t} stage {stage}: {task} outside {self.microbatches} microbatches "
                                     f"x {self.chunks} chunks")
                        continue
                    c = self.logical_chunk(stage, task.chunk)
                    key = (slot.work, task.microbatch, c)
                    if key in done:
                        found.append(f"{slot.work.value}{(task.microbatch, c)} runs twice")
                    done[key] = (t, k)
                    if slot.work is Work.FORWARD and c == self.last_chunk:
                        head_at[task.microbatch] = (t, k)
        if found:
            return found

        def before(need: tuple[int, int] | None, at: tuple[int, int], next_tick: bool) -> bool:
            return need is not None and (need[0] < at[0] if next_tick else need < at)

        for (work, m, c), at in done.items():
            name = f"{work.value} of microbatch {m} on logical chunk {c}"
            if work is Work.FORWARD:
                if c > 0 and not before(done.get((Work.FORWARD, m, c - 1)), at, True):
                    found.append(f"{name} runs before the previous chunk's forward has arrived")
                continue
            if work is Work.WEIGHT_GRAD:
                if not before(done.get((Work.INPUT_GRAD, m, c)), at, False):
                    found.append(f"{name} runs without an earlier I")
                continue
            if not before(done.get((Work.FORWARD, m, c)), at, False):
                found.append(f"{name} runs before its forward")
            if c == self.last_chunk:
                if not before(head_at.get(m), at, False):
                    found.append(f"{name} runs before the head of microbatch {m}")
            elif not any(before(done.get((w, m, c + 1)), at, True) for w in SENDS_GRADIENT):
                found.append(f"{name} runs before the next chunk's gradient has arrived")
        trains = any(work is not Work.FORWARD for work, *_ in done)
        for m in range(self.microbatches):
            for c in range(self.stages * self.chunks):
                if (Work.FORWARD, m, c) not in done:
                    found.append(f"F of microbatch {m} on logical chunk {c} never runs")
                whole = (Work.BACKWARD, m, c) in done
                halves = [(w, m, c) in done for w in (Work.INPUT_GRAD, Work.WEIGHT_GRAD)]
                if trains and not ((whole and not any(halves)) or (all(halves) and not whole)):
                    found.append(f"microbatch {m} on logical chunk {c} needs exactly one B, or one I and one W")
        return found

    # ----- buffers -----
    @_kept
    def buffers(self) -> tuple[Columns, Buffers]:
        """Static buffer slots for every task (lowest free slot at each allocation): the table's
        ``Columns`` (-1 where unused) and the number of slots of each buffer."""
        ticks, stages = len(self.ticks), self.stages
        new = lambda: np.full((ticks, stages), -1, np.int32)
        columns = Columns(ForwardTasks(new(), new(), new(), new()), BackwardTasks(new(), new(), new(), new()),
                          InputGradTasks(new(), new(), new(), new(), new()),
                          WeightGradTasks(new(), new(), new(), new()), new(), new(), new())
        free: dict[str, list[set[int]]] = {b: [set() for _ in range(stages)]
                                           for b in ("inputs", "gradients", "stash", "cut")}
        size = dict.fromkeys(free, 0)
        held: dict[tuple[str, int, int, int], int] = {}  # (buffer, stage, microbatch, logical) -> slot
        # Slots each stage has created per buffer: with none free, every one of them is held.
        created = {buffer: [0] * stages for buffer in free}

        def take(buffer: str, stage: int, key: tuple[int, int]) -> int:
            pool = free[buffer][stage]
            if pool:
                slot = min(pool)
                pool.discard(slot)
            else:
                slot = created[buffer][stage]
                created[buffer][stage] += 1
            size[buffer] = max(size[buffer], slot + 1)
            held[(buffer, stage, *key)] = slot
            return slot

        def release(buffer: str, stage: int, key: tuple[int, int]) -> int:
            slot = held.pop((buffer, stage, *key))
            free[buffer][stage].add(slot)
            return slot

        for t, tick in enumerate(self.ticks):
            arriving_inputs, arriving_gradients = [], []
            for slot in tick:
                for stage, task in enumerate(slot.tasks):
                    if task is None:
                        continue
                    c = self.logical_chunk(stage, task.chunk)
                    key = (task.microbatch, c)
                    tasks = columns.of(slot.work)
                    tasks.microbatch[t, stage], tasks.chunk[t, stage] = task.microbatch, task.chunk
                    if slot.work is Work.FORWARD:
                        if c > 0:
                            columns.forward.input[t, stage] = release("inputs", stage, key)
                        columns.forward.stash[t, stage] = take("stash", stage, key)
                        if c < self.last_chunk:
                            arriving_inputs.append(((stage + 1) % stages, (task.microbatch, c + 1)))
                        else:
                            columns.head_gradient[t, stage] = take("gradients", stage, key)
                    elif slot.work in SENDS_GRADIENT:
                        tasks.gradient[t, stage] = release("gradients", stage, key)
                        if slot.work is Work.BACKWARD:
                            tasks.stash[t, stage] = release("stash", stage, key)
                        else:
                            tasks.stash[t, stage] = held[("stash", stage, *key)]
                            tasks.cut[t, stage] = take("cut", stage, key)
                        if c > 0:
                            arriving_gradients.append(((stage - 1) % stages, (task.microbatch, c - 1)))
                    else:
                        tasks.stash[t, stage] = release("stash", stage, key)
                        tasks.cut[t, stage] = release("cut", stage, key)
            for stage, key in arriving_inputs:
                columns.receive_input[t, stage] = take("inputs", stage, key)
            for stage, key in arriving_gradients:
                columns.receive_gradient[t, stage] = take("gradients", stage, key)
        return columns, Buffers(**{name: max(n, 1) for name, n in size.items()})

    # ----- files -----
    def to_json(self) -> str:
        ticks = [[{"work": s.work.value, "tasks": [None if x is None else [x.microbatch, x.chunk] for x in s.tasks]}
                  for s in tick] for tick in self.ticks]
        return json.dumps({"stages": self.stages, "chunks": self.chunks, "microbatches": self.microbatches,
                           "ticks": ticks})

    @classmethod
    def from_json(cls, text: str, field: str = "pipeline.table") -> ScheduleTable:
        try:
            data = jsonio.loads(text)
            ticks = tuple(tuple(Slot(Work(s["work"]), tuple(None if x is None else Task(_count(x[0]), _count(x[1]))
                                                            for x in s["tasks"])) for s in tick)
                          for tick in data["ticks"])
            return cls(_count(data["stages"]), _count(data["chunks"]), _count(data["microbatches"]), ticks)
        except (ValueError, KeyError, TypeError, IndexError) as error:
            raise ConfigError(field, "must be a JSON schedule table {stages, chunks, microbatches, ticks: "
                              "[[{work: F|B|I|W, tasks: [[microbatch, chunk] or null per stage]}]]}: "
                              f"{type(error).__name__}: {error}") from None


def _count(value) -> int:
    """A table's integer (a JSON integer >= 0), or ``ValueError``: no floats (``2.5``, ``Infinity``,
    ``1e400``), no booleans."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not an integer >= 0")
    return value


def _table(stages: int, chunks: int, microbatches: int,
           placed: Iterable[tuple[int, Work, int, Task]], order: tuple[Work, ...]) -> ScheduleTable:
    """A table from ``(tick, work, stage, task)`` placements; slots within a tick in ``order``."""
    grid: dict[int, dict[Work, list[Task | None]]] = {}
    for tick, work, stage, task in placed:
        row = grid.setdefault(tick, {}).setdefault(work, [None] * stages)
        assert row[stage] is None, (tick, work, stage)
        row[stage] = task
    ticks = tuple(tuple(Slot(w, tuple(grid[t][w])) for w in order if w in grid.get(t, {}))
                  for t in range(max(grid) + 1))
    return ScheduleTable(stages, chunks, microbatches, ticks)


@functools.lru_cache(maxsize=512)
def gpipe(stages: int, microbatches: int) -> ScheduleTable:
    """All forwards (F(m) on stage s at tick m+s), then all backwards in reverse."""
    S, M = stages, microbatches
    placed = [(m + s, Work.FORWARD, s, Task(m)) for m in range(M) for s in range(S)]
    placed += [(M + S - 1 + (M - 1 - m) + (S - 1 - s), Work.BACKWARD, s, Task(m)) for m in range(M) for s in range(S)]
    return _table(S, 1, M, placed, (Work.FORWARD, Work.BACKWARD))


@functools.lru_cache(maxsize=512)
def one_f_one_b(stages: int, microbatches: int) -> ScheduleTable:
    """F(m) on stage s at tick m+s, B(m) at tick m+2S-2-s (the last stage's B follows its F and the
    head in the same tick)."""
    S, M = stages, microbatches
    placed = [(m + s, Work.FORWARD, s, Task(m)) for m in range(M) for s in range(S)]
    placed += [(m + 2 * S - 2 - s, Work.BACKWARD, s, Task(m)) for m in range(M) for s in range(S)]
    return _table(S, 1, M, placed, (Work.FORWARD, Work.BACKWARD))


@functools.lru_cache(maxsize=512)
def interleaved_1f1b(stages: int, microbatches: int, chunks: int) -> ScheduleTable:
    """Megatron's interleaved 1F1B: microbatch m = g*S + i walks chunk v; F(m, v) on stage s at tick
    g*S*V + v*S + i + s, B(m, v) at tick g*S*V + i + (2V - v)*S - 2 - s. Needs M % S == 0."""
    S, M, V = stages, microbatches, chunks
    if M % S:
        raise ConfigError("pipeline.microbatches", f"interleaved 1F1B needs a multiple of mesh.stage={S}, got {M}")
    placed = []
    for m in range(M):
        g, i = divmod(m, S)
        for v in range(V):
            for s in range(S):
                placed.append((g * S * V + v * S + i + s, Work.FORWARD, s, Task(m, v)))
                placed.append((g * S * V + i + (2 * V - v) * S - 2 - s, Work.BACKWARD, s, Task(m, v)))
    return _table(S, V, M, placed, (Work.FORWARD, Work.BACKWARD))


@functools.lru_cache(maxsize=512)
def zb_h1(stages: int, microbatches: int) -> ScheduleTable:
    """ZB-H1: 1F1B's F and (input-gradient) I; every stage's W(m) at tick m+2S-2, so only M ticks
    carry a W slot."""
    S, M = stages, microbatches
    placed = [(m + s, Work.FORWARD, s, Task(m)) for m in range(M) for s in range(S)]
    placed += [(m + 2 * S - 2 - s, Work.INPUT_GRAD, s, Task(m)) for m in range(M) for s in range(S)]
    placed += [(m + 2 * S - 2, Work.WEIGHT_GRAD, s, Task(m)) for m in range(M) for s in range(S)]
    return _table(S, 1, M, placed, (Work.FORWARD, Work.INPUT_GRAD, Work.WEIGHT_GRAD))
