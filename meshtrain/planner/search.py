"""The planner's search: every layout of a config on N devices, each estimated (``meshtrain.plan``
is its command line).

``make_plan`` enumerates every ``(data, fsdp, tensor, stage)`` factorisation of N devices (tensor
inside a node) x sharding preset (the config's, sequence parallelism, and context parallelism for rows
of ``LONG_SEQUENCE`` positions or more) x ZeRO stage 0-3 x remat policy x pipeline schedule (GPipe,
1F1B, interleaved 1F1B over 2 virtual stages, ZB-H1) and microbatches (when ``stage`` > 1) [x
optimizer offload, when host memory is given] [x gradient accumulation, while a layout is too big for
its activations], and estimates each one's per-device memory and step time analytically
(``meshtrain.planner.estimate``, docs/memory.md); ``Plan`` ranks them. When none fits,
``single_changes`` searches again with one change at a time (remat, offload, sequence, devices).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numpy as np
from collections.abc import Callable

from meshtrain.config import Config
from meshtrain.errors import ConfigError
from meshtrain.mesh import MESH_AXES
from meshtrain.parallel.layout import Layout, abstract_model
from meshtrain.parallel.offload import OffloadConfig
from meshtrain.parallel.pipeline import Schedule
from meshtrain.parallel.rules import Preset, ShardingRules, mesh_axes_of
from meshtrain.parallel.zero import ZeroConfig, ZeroStage
from meshtrain.planner.cache import Cache
from meshtrain.planner.constants import MODELLED_REMATS, TABLES, TEMP_MARGIN
from meshtrain.planner.estimate import Candidate, Estimate, estimate
from meshtrain.planner.roofline import Hardware
from models.api import family_of
from models.common import RematPolicy

GB = 1e9
DEFAULT_REMATS = (RematPolicy.NONE, RematPolicy.FULL, RematPolicy.DOTS)


@dataclasses.dataclass
class Plan:
    """Every enumerated layout's estimate, and the limits they were judged against."""

    cfg: Config
    devices: int
    device_memory: float
    host_memory: float | None
    hardware: Hardware
    estimates: list[Estimate]

    def fits(self, est: Estimate) -> bool:
        return not self.problems(est)

    def problems(self, est: Estimate) -> list[str]:
        """Why ``est`` cannot run: structural reasons, else memory over the limits."""
        if est.reasons:
            return est.reasons
        out = []
        if est.total > self.device_memory:
            out.append(f"needs {est.total / GB:.1f} GB > {self.device_memory / GB:.4g} GB")
        if self.host_memory is not None and est.optimizer_host > self.host_memory:
            out.append(f"host needs {est.optimizer_host / GB:.1f} GB > {self.host_memory / GB:.4g} GB")
        return out

    def certain(self, est: Estimate) -> bool:
        """Whether the estimate vouches for ``est`` fitting: its temp bytes are checked at scale
        (``Estimate.reliable``: no pipeline) and fit ``TEMP_MARGIN`` larger too (verdict ``fits``;
        otherwise ``fits?``)."""
        return est.reliable and est.total + TEMP_MARGIN * est.temp_bytes <= self.device_memory

    def ranked(self) -> tuple[list[Estimate], list[Estimate], list[Estimate]]:
        """(fit: the layouts the estimate vouches for (``certain``) first, each group by step time;
        too big, by memory needed; cannot be built). A layout whose fit is not certain (a pipeline's
        temporaries are not checked at scale; or it fits only within the model's measured error)
        never ranks above one that is: the first row (which ``--write-config`` writes) is one the
        estimate can vouch for whenever there is one."""
        fit = sorted((e for e in self.estimates if self.fits(e)),
                     key=lambda e: (not self.certain(e), e.step_s, e.total))
        big = sorted((e for e in self.estimates if not e.reasons and not self.fits(e)), key=lambda e: e.total)
        broken = [e for e in self.estimates if e.reasons]
        return fit, big, broken


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(devices: int, rules: ShardingRules) -> list[tuple[int, int, int, int]]:
    """Every (data, fsdp, tensor, stage) of ``devices`` devices in which each axis of size > 1 splits
    something: ``fsdp`` and ``tensor`` only where ``rules`` use them (``stage`` splits the layers)."""
    out = []
    for data in _divisors(devices):
        for fsdp in _divisors(devices // data) if rules.uses("fsdp") else [1]:
            for tensor in _divisors(devices // data // fsdp) if rules.uses("tensor") else [1]:
                out.append((data, fsdp, tensor, devices // data // fsdp // tensor))
    return out



MAX_DEVICES = 2 ** 20  # beyond any cluster; the factorisations of 10**12 devices took hours


# The pipeline schedules the search tries (schedule, virtual stages); a custom table only when the
# config names one.
SEARCHED_SCHEDULES = ((Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED, 2), (Schedule.ZB_H1, 1))


# The presets that lay out what fsdp_tp does and differ in how they split the sequence: sequence
# parallelism (positions of the residual stream over tensor) and context parallelism (every position
# axis over fsdp; keys all-gathered, or passed round a ring). A config of one of them searches the
# others as below; a config of dp, fsdp or tp keeps its own (``--preset`` widens it).
SEQUENCE_PRESETS = (Preset.FSDP_TP, Preset.FSDP_TP_SP, Preset.FSDP_CP, Preset.FSDP_TP_CP, Preset.FSDP_CP_RING)
CONTEXT_PRESETS = (Preset.FSDP_CP, Preset.FSDP_TP_CP, Preset.FSDP_CP_RING)
# The presets whose pipelines the estimate does not vouch for: they split the sequence inside the
# stages, which no pipeline of the accuracy matrix does (``Estimate.pipelines_checked``).
SPLIT_SEQUENCE = (Preset.FSDP_TP_SP, *CONTEXT_PRESETS)
# Rows of this many positions or more add the context-parallel presets to the search: the shipped
# long-row configs (llama_8b, llama_70b: 8,192) are searched with them, the 4,096-position ones
# without. Below it a row's activations are a small part of a device's memory at the batch sizes
# people train with, while CP's key/value gathers cost every layer, and the three presets more than
# double the search's time (docs/memory.md). ``--preset`` searches them at any length.
LONG_SEQUENCE = 8192


def search_presets(cfg: Config) -> list[Preset]:
    """The sharding presets ``python -m meshtrain.plan`` searches without ``--preset``: the config's
    own and, when it is one of ``SEQUENCE_PRESETS``, sequence parallelism (``fsdp_tp_sp``: tried
    on meshes with tensor > 1, where it differs from ``fsdp_tp``) and, for rows of ``LONG_SEQUENCE``
    positions or more, the context-parallel presets (tried where fsdp > 1)."""
    own = cfg.sharding.preset
    if own not in SEQUENCE_PRESETS:
        return [own]
    extra = [Preset.FSDP_TP_SP] + (list(CONTEXT_PRESETS) if cfg.model.seq_len >= LONG_SEQUENCE else [])
    return list(dict.fromkeys([own, *extra]))


def _schedules(cfg: Config, stage: int, schedules: list[Schedule] | None) -> list[tuple[Schedule, int]]:
    """(schedule, virtual stages) to try on ``stage`` pipeline stages: ``schedules`` (default: all
    of ``SEARCHED_SCHEDULES``; the config's own custom table alone), interleaving only where the
    layers split into 2 chunks per stage."""
    if cfg.pipeline.schedule is Schedule.CUSTOM:
        return [(Schedule.CUSTOM, cfg.pipeline.virtual_stages)]
    wanted = SEARCHED_SCHEDULES if schedules is None else [(s, 2 if s is Schedule.INTERLEAVED else 1)
                                                            for s in schedules]
    return [(s, v) for s, v in wanted if v == 1 or cfg.model.num_layers % (stage * v) == 0]


def make_plan(cfg: Config, devices: int, device_memory: float, host_memory: float | None = None, *,
              hardware: Hardware = Hardware(), meshes: list[tuple[int, int, int, int]] | None = None,
              zero_stages: list[int] = (0, 1, 2, 3), remats: list[RematPolicy] = DEFAULT_REMATS,
              schedules: list[Schedule] | None = None, presets: list[Preset] | None = None,
              search_accumulation: bool = True, progress: Callable[[int], None] | None = None) -> Plan:
    """Estimates of every candidate layout of ``cfg`` on ``devices`` devices; with a pipeline, under
    each of ``schedules`` (default: GPipe, 1F1B, interleaved over 2 virtual stages and ZB-H1); under
    each of ``presets`` (default: the config's own; ``search_presets`` gives the CLI's), the config's
    ``sharding.rules`` overrides kept, except where a preset splits on a mesh exactly what an earlier
    one does, and the presets after the first on pipelined meshes only when no layout without a
    pipeline fits where their pipelines are not vouched for (the compiler's ``checked_pipelines``;
    never where they split the sequence: ``SPLIT_SEQUENCE``), as such a row would rank after it
    (``Plan.ranked``); with
    ``search_accumulation``, a candidate too big for the device memory is tried again in more
    gradient-accumulation steps (doubled; the global batch kept) until it fits or the batch no longer
    divides (``_Search.accumulate``). A mesh refused whatever else is chosen (a tensor axis wider
    than ``hardware.node_size`` devices) gets one row that says why, nothing estimated.
    ``progress`` is called with the number of layouts estimated so far after each one."""
    if not 1 <= devices <= MAX_DEVICES:
        raise ConfigError("--devices", f"must be an integer in [1, {MAX_DEVICES:,}], got {devices:,}")
    for remat in remats:
        if remat not in MODELLED_REMATS:
            raise ConfigError("--remat", f"{remat.value!r} is not modelled; use one of "
                              f"{[r.value for r in MODELLED_REMATS]}")
    presets = list(dict.fromkeys([cfg.sharding.preset] if presets is None else presets))
    if not presets:
        raise ConfigError("--preset", "give at least one sharding preset")
    rules = {preset: preset_rules(cfg, preset) for preset in presets}
    completed = {preset: r.completed(family_of(cfg.model).axis_roles) for preset, r in rules.items()}
    searched = {preset: _meshes(devices, r) for preset, r in rules.items()} if meshes is None else {}
    allowed = {preset: set(found) for preset, found in searched.items()}
    deferred = []  # (mesh, preset, rules) of the presets after the first on pipelined meshes
    pipelines_vouched = TABLES[hardware.compiler].checked_pipelines
    search = _Search(cfg, abstract_model(cfg.model)[1], np.dtype(cfg.train.compute_dtype).itemsize, hardware,
                     device_memory, sorted({False, True} if host_memory is not None else {cfg.offload.optimizer}),
                     zero_stages, remats, schedules, search_accumulation, progress)
    for mesh in meshes if meshes is not None else list(dict.fromkeys(itertools.chain(*searched.values()))):
        if math.prod(mesh) != devices:
            raise ConfigError("--mesh", f"{mesh} multiplies to {math.prod(mesh)}, not --devices {devices}")
        splits = set()  # what each preset tried on this mesh splits: a preset that splits the same is skipped
        for preset in presets:
            split = _splits(completed[preset], dict(zip(MESH_AXES, mesh)))
            if split in splits or (meshes is None and mesh not in allowed[preset]):
                continue
            splits.add(split)
            work = (mesh, None if preset is cfg.sharding.preset else preset, rules[preset])
            if preset is not presets[0] and mesh[3] > 1 and (not pipelines_vouched or preset in SPLIT_SEQUENCE):
                deferred.append(work)
            else:
                search.mesh(*work)
    plan = Plan(cfg, devices, device_memory, host_memory, hardware, search.estimates)
    # An unvouched pipelined row ranks after every row that fits for certain (``Plan.ranked``): the
    # deferred presets' pipelines could not be first while a layout without a pipeline fits.
    if not any(plan.fits(est) for est in plan.estimates if est.candidate.stage == 1):
        for work in deferred:
            search.mesh(*work)
    return plan


def _splits(rules: ShardingRules, mesh: dict[str, int]) -> tuple:
    """What ``rules`` split on ``mesh``: per logical axis, the mesh axes of size > 1 at rest and in
    compute. Two presets with the same lay out every tensor alike there (``fsdp_cp`` on fsdp = 1 is
    ``fsdp_tp`` on tensor = 1)."""
    def used(axes) -> tuple[str, ...]:
        return tuple(a for a in mesh_axes_of(axes) if mesh[a] > 1)

    return tuple(sorted((name, used(rule.params), used(rule.activations)) for name, rule in rules.table.items()))


@dataclasses.dataclass
class _Search:
    """What ``make_plan`` keeps across the meshes and presets of one search: the candidates' fixed
    choices, the estimates so far, and the search's cache (``meshtrain.planner.cache``: the completed
    rules per preset and pipelining, and what ``estimate`` computes once)."""

    cfg: Config
    abstract_params: object
    compute_bytes: int
    hardware: Hardware
    device_memory: float
    offloads: list[bool]
    zero_stages: list[int]
    remats: list[RematPolicy]
    schedules: list[Schedule] | None
    search_accumulation: bool
    progress: Callable[[int], None] | None
    estimates: list[Estimate] = dataclasses.field(default_factory=list)
    cache: Cache = dataclasses.field(default_factory=Cache)

    def add(self, est: Estimate) -> None:
        self.estimates.append(est)
        if self.progress is not None:
            self.progress(len(self.estimates))

    def mesh(self, mesh: tuple[int, int, int, int], preset: Preset | None, rules: ShardingRules) -> None:
        """Estimates the candidates of ``mesh`` under ``preset`` (None: the config's), laid out by ``rules``."""
        cfg = self.cfg
        data, fsdp, tensor, stage = mesh
        zeros = sorted(set(self.zero_stages)) if fsdp > 1 else [min(self.zero_stages)]  # no fsdp: stages equal
        if tensor > self.hardware.node_size:
            # Refused whatever the other choices: tensor parallelism's all-reduces run every layer,
            # so it is placed inside a node. One row says why (with the layout's other problems);
            # nothing is estimated.
            candidate = Candidate(data, fsdp, tensor, stage, zeros[0], self.remats[0], preset=preset)
            layout = candidate_layout(cfg, candidate, rules, self.abstract_params)
            node = [f"tensor={tensor} spans more than a node of {self.hardware.node_size} (--node-size)"]
            self.add(Estimate(candidate, reasons=node[:tensor > self.hardware.node_size]
                              + [problem.reason for problem in layout.problems()]))
            return
        dp = rules.data_parallel_size(dict(zip(MESH_AXES, mesh)))
        rows = cfg.train.batch_size // (dp * cfg.train.grad_accum)
        micros = [cfg.pipeline.microbatches]
        if stage > 1:
            micros = [m for m in (stage, 2 * stage, 4 * stage, 8 * stage) if rows and rows % m == 0] or micros
        pipelines = _schedules(cfg, stage, self.schedules) if stage > 1 else [(None, 1)]
        for zero, remat, micro, offload, (schedule, virtual) in itertools.product(zeros, self.remats, micros,
                                                                                   self.offloads, pipelines):
            first = self.estimate(Candidate(data, fsdp, tensor, stage, zero, remat, micro, offload,
                                            cfg.train.grad_accum, schedule, virtual, preset), rules)
            self.add(first)
            if self.search_accumulation and not first.reasons and first.total > self.device_memory:
                # Too big for its activations' sake: the same step in more accumulation steps.
                doublings, accum = [], cfg.train.grad_accum * 2
                while _accumulation_divides(cfg.train.batch_size, dp, accum, micro, stage):
                    doublings.append(accum)
                    accum *= 2
                self.accumulate(first, doublings, rules)

    def accumulate(self, first: Estimate, doublings: list[int], rules: ShardingRules) -> None:
        """The layout ``first``, too big, in the fewest of ``doublings`` accumulation steps (the global
        batch kept) that fits, found by bisection: the bytes fall as the accumulation grows (the
        activations of fewer rows at a time), past the accumulator that a second step adds. The
        doublings tried are listed (those too big among them too); none when twice ``first``'s
        steps need no less memory (the state, not the activations, is too big)."""
        def at(steps: int) -> Estimate:
            return self.estimate(dataclasses.replace(first.candidate, grad_accum=steps), rules)

        if not doublings:
            return
        second = at(doublings[0])
        if second.total >= first.total:
            return
        self.add(second)
        if second.total <= self.device_memory or len(doublings) == 1:
            return
        last = at(doublings[-1])
        if last.total > self.device_memory:
            if last.total < second.total:
                self.add(last)  # the smallest that does not fit
            return
        low, high, fitting = 1, len(doublings) - 1, last  # doublings[low - 1] is too big, doublings[high] fits
        while low < high:
            middle = (low + high) // 2
            est = at(doublings[middle])
            if est.total <= self.device_memory and not est.reasons:
                high, fitting = middle, est
            else:
                low = middle + 1
                self.add(est)
        self.add(fitting)

    def estimate(self, candidate: Candidate, rules: ShardingRules) -> Estimate:
        """``estimate`` of ``candidate`` laid out by ``rules``, with the search's cache."""
        layout = candidate_layout(self.cfg, candidate, rules, self.abstract_params)
        # The family-completed rules depend on the preset and on whether there is a pipeline only:
        # filled in like ``Layout.of`` fills the graphdef (a fifth of the search's time).
        layout.__dict__["rules"] = self.cache.get(_completed_rules, (candidate.preset, candidate.stage > 1), layout)
        return estimate(layout, candidate, compute_bytes=self.compute_bytes, hw=self.hardware, cache=self.cache,
                        device_memory=self.device_memory)


def _completed_rules(layout: Layout) -> ShardingRules:
    return layout.rules


def _accumulation_divides(batch_size: int, dp: int, accum: int, microbatches: int, stages: int) -> bool:
    """Whether ``batch_size`` rows split into ``dp`` shards of ``accum`` accumulation steps (each
    into ``microbatches`` when pipelined) evenly."""
    if batch_size % (dp * accum):
        return False
    return stages == 1 or (batch_size // (dp * accum)) % microbatches == 0


def preset_rules(cfg: Config, preset: Preset | None) -> ShardingRules:
    """The rules table of ``preset`` (None: the config's own) with the config's per-axis
    ``sharding.rules`` overrides and ring settings kept: what ``sharding.preset=...`` gives."""
    return (cfg.sharding if preset is None else dataclasses.replace(cfg.sharding, preset=preset)).resolve()


def candidate_layout(cfg: Config, candidate: Candidate, rules: ShardingRules | None = None,
                     abstract_params=None) -> Layout:
    """The ``Layout`` of ``cfg`` with ``candidate`` applied: the object the trainer builds from.
    ``rules``: ``preset_rules(cfg, candidate.preset)``, when the caller has them."""
    rules = preset_rules(cfg, candidate.preset) if rules is None else rules
    pipeline = cfg.pipeline
    if candidate.stage > 1:
        pipeline = dataclasses.replace(pipeline, microbatches=candidate.microbatches)
        if candidate.schedule is not None:
            pipeline = dataclasses.replace(pipeline, schedule=candidate.schedule,
                                           virtual_stages=candidate.virtual_stages)
    train = dataclasses.replace(cfg.train, grad_accum=candidate.grad_accum)
    return Layout.of(dataclasses.replace(cfg.model, remat=candidate.remat), candidate.mesh, rules, train, pipeline,
                     ZeroConfig(ZeroStage(candidate.zero)), OffloadConfig(optimizer=candidate.offload),
                     abstract_params=abstract_params)


@dataclasses.dataclass(frozen=True)
class Change:
    """One change to a question that nothing fits, and the estimate's answer to it: ``flag``, what to
    type (``--remat full``, ``--host-memory 12GB``, ``model.seq_len=4096``, ``--devices 16``);
    ``best``, the first layout of the plan with it that fits (None: still none); ``needed``, the
    least memory a layout then needs."""

    flag: str
    best: Estimate | None
    needed: float


# More devices tried when nothing fits: these multiples of the count asked for (8 -> 16, 32, 64).
MORE_DEVICES = (2, 4, 8)


def single_changes(plan: Plan, zero_stages: list[int] = (0, 1, 2, 3), remats: list[RematPolicy] = DEFAULT_REMATS,
                   presets: list[Preset] | None = None,
                   meshes: list[tuple[int, int, int, int]] | None = None) -> list[Change]:
    """When nothing in ``plan`` fits (searched with ``zero_stages``, ``remats``, ``presets``,
    ``meshes``): single changes tried in turn, cheapest first, up to the first that fits (the last
    of the list, when one does): remat ``full`` (where ``remats`` leave it out), the optimizer offloaded
    (where no host memory was given), ``model.seq_len`` halved (down to an eighth), then more devices (the
    smallest multiple of ``plan.devices`` in ``MORE_DEVICES`` that fits; any mesh). Each is the same estimate in
    a narrower search: the largest ZeRO stage and remat ``full`` of those searched (the least memory)
    and 1F1B pipelines. Gradient accumulation needs no change: ``make_plan`` searches it."""
    remat = [RematPolicy.FULL] if RematPolicy.FULL in remats else list(remats)
    narrow = dict(hardware=plan.hardware, zero_stages=[max(zero_stages)], schedules=[Schedule.ONE_F_ONE_B],
                  presets=presets)
    tries: list[tuple[str, Callable[[], Plan]]] = []
    if RematPolicy.FULL not in remats:
        tries.append(("--remat full", lambda: make_plan(plan.cfg, plan.devices, plan.device_memory, plan.host_memory,
                                                         meshes=meshes, remats=[RematPolicy.FULL], **narrow)))
    if plan.host_memory is None:
        tries.append(("--host-memory", lambda: make_plan(plan.cfg, plan.devices, plan.device_memory, math.inf,
                                                          meshes=meshes, remats=remat, **narrow)))
    seq = plan.cfg.model.seq_len
    for length in (seq // 2, seq // 4, seq // 8):
        try:
            shorter = dataclasses.replace(plan.cfg, model=dataclasses.replace(plan.cfg.model, seq_len=length))
        except ValueError:  # a length the model refuses (a routing group longer than the row)
            continue
        if length >= 1:
            tries.append((f"model.seq_len={length}", lambda cfg=shorter: make_plan(
                cfg, plan.devices, plan.device_memory, plan.host_memory, meshes=meshes, remats=remat, **narrow)))
    for count in (plan.devices * k for k in MORE_DEVICES):
        tries.append((f"--devices {count}", lambda n=count: make_plan(plan.cfg, n, plan.device_memory,
                                                                       plan.host_memory, remats=remat, **narrow)))
    changes = []
    for flag, search in tries:
        fit, big, _ = search().ranked()
        best = fit[0] if fit else None
        if flag == "--host-memory":  # how much it takes, where the offload fits
            flag = f"--host-memory {math.ceil(best.optimizer_host / GB)}GB" if best else "offload (--host-memory)"
        changes.append(Change(flag, best, min((e.total for e in fit + big), default=math.inf)))
        if best is not None:
            break
    return changes
