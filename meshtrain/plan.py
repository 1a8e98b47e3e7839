"""Choose the layout that fits: ``python -m meshtrain.plan --config X.yaml --devices N --device-memory 80GiB``.

Enumerates every ``(data, fsdp, tensor, stage)`` factorisation of N devices (tensor inside a node)
x sharding preset (the config's, sequence parallelism, and context parallelism for rows of
``LONG_SEQUENCE`` positions or more) x ZeRO stage 0-3 x remat policy x pipeline schedule (GPipe,
1F1B, interleaved 1F1B over 2 virtual stages, ZB-H1) and microbatches (when ``stage`` > 1) [x
optimizer offload, when ``--host-memory`` is given] [x gradient accumulation, doubled while a layout
is too big for its activations], estimates each one's
per-device memory and step time analytically (``meshtrain.memory_model``, docs/memory.md), and
prints them ranked: layouts that fit first, by estimated step time. Layouts that cannot run say
why. ``--verify K`` compiles the K best with the real train step ahead of time on N simulated CPU
devices and prints XLA's memory analysis beside the estimate.

Bad input prints one ``error: field: what is wrong`` line and exits 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import dataclasses
import itertools
import math
import pathlib
import re
import sys
import time

import numpy as np
import yaml

from meshtrain.cli import ArgumentParser, run
from meshtrain.config import Config, load_config, to_dict
from meshtrain.errors import ConfigError
from meshtrain.memory_model import (ACTIVATION_COEFFICIENTS, TEMP_MARGIN, UNRELIABLE, Candidate, Estimate, Hardware,
                                    SpecTables, estimate, spec_tables)
from meshtrain.mesh import MESH_AXES
from meshtrain.metrics import peak_bf16_tflops
from meshtrain.parallel.layout import Layout, abstract_model
from meshtrain.parallel.offload import OffloadConfig
from meshtrain.parallel.pipeline import Schedule
from meshtrain.parallel.rules import Preset, ShardingRules, mesh_axes_of
from meshtrain.parallel.sharding import data_parallel_size, ring_axis
from meshtrain.parallel.zero import ZeroConfig, ZeroStage
from models.api import family_of
from models.common import RematPolicy

GB = 1e9
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
          "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40, "pi": 2 ** 50}
DEFAULT_REMATS = (RematPolicy.NONE, RematPolicy.FULL, RematPolicy.DOTS)


def parse_bytes(text: str, field: str) -> float:
    """``"80GiB"`` -> 85899345920.0; ``40GB``, ``1TiB``, ``512MB``, ``2.5G``, plain bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]i?)?b?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(field, f"cannot read {text!r} as a size; use e.g. 80GiB, 40GB, 1TiB or a byte count")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value <= 0:
        raise ConfigError(field, f"must be > 0, got {text!r}")
    return value


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m meshtrain.plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML config (default: the dataclass defaults)")
    p.add_argument("--devices", type=int, required=True, help="number of devices N")
    p.add_argument("--device-memory", required=True, help="memory per device, e.g. 80GiB or 40GB")
    p.add_argument("--host-memory", help="pinned host memory available to each device for optimizer offload "
                   "(a node's host memory divided by its devices), e.g. 128GiB")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="compile the K best layouts on N simulated CPU devices and compare")
    p.add_argument("--top", type=int, default=20, help="rows of layouts that fit to print")
    p.add_argument("--show-infeasible", type=int, default=8, metavar="K",
                   help="rows of layouts that do not fit (and distinct structural reasons) to print")
    p.add_argument("--mesh", action="append", default=[], metavar="D,F,T,S",
                   help="only this mesh (data,fsdp,tensor,stage); repeatable")
    p.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider (comma list)")
    p.add_argument("--remat", default="none,full,dots", help="remat policies to consider (comma list)")
    p.add_argument("--schedule", help="pipeline schedules to consider (comma list of gpipe, 1f1b, interleaved "
                   "(over 2 virtual stages), zb_h1; default: all)")
    p.add_argument("--preset", help="sharding presets to consider (comma list of "
                   f"{', '.join(p.value for p in Preset)}; default: the config's, and when that is fsdp_tp or "
                   f"one of its sequence variants also fsdp_tp_sp and, from seq_len {LONG_SEQUENCE}, fsdp_cp, "
                   "fsdp_tp_cp and fsdp_cp_ring)")
    p.add_argument("--device-kind", default="H100", help="device for the peak FLOP/s table (meshtrain.metrics)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak TFLOP/s per device (overrides --device-kind)")
    p.add_argument("--intra-node-bandwidth", default="450GB",
                   help="bytes/s per device over links inside a node (NVLink; default 450GB)")
    p.add_argument("--inter-node-bandwidth", default="50GB",
                   help="bytes/s per device across nodes (one 400 Gb/s NIC per GPU; default 50GB)")
    p.add_argument("--node-size", type=int, default=8,
                   help="devices per node (default 8); a mesh with tensor > node size is refused in one line")
    p.add_argument("--write-config", metavar="FILE",
                   help="write the config with the best layout applied, for meshtrain.train --config FILE")
    return p.parse_args(argv)


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


def _parse_list(text: str, field: str, parse) -> list:
    try:
        return [parse(item.strip()) for item in text.split(",") if item.strip()]
    except (ValueError, KeyError):
        raise ConfigError(field, f"cannot read {text!r}; give a comma-separated list") from None


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
    pipeline fits (a pipelined row would rank after it: ``Plan.ranked``); with
    ``search_accumulation``, a candidate too big for the device memory is tried again in more
    gradient-accumulation steps (doubled; the global batch kept) until it fits or the batch no longer
    divides (``_Search.accumulate``). A mesh refused whatever else is chosen (a tensor axis wider
    than ``hardware.node_size`` devices, ring attention inside pipeline stages) gets one row that
    says why, nothing estimated. ``progress`` is called with the number of layouts estimated so far
    after each one."""
    if not 1 <= devices <= MAX_DEVICES:
        raise ConfigError("--devices", f"must be an integer in [1, {MAX_DEVICES:,}], got {devices:,}")
    for remat in remats:
        if remat not in ACTIVATION_COEFFICIENTS:
            raise ConfigError("--remat", f"{remat.value!r} is not modelled; use one of "
                              f"{[r.value for r in ACTIVATION_COEFFICIENTS]}")
    presets = list(dict.fromkeys([cfg.sharding.preset] if presets is None else presets))
    if not presets:
        raise ConfigError("--preset", "give at least one sharding preset")
    rules = {preset: preset_rules(cfg, preset) for preset in presets}
    completed = {preset: r.completed(family_of(cfg.model).axis_roles) for preset, r in rules.items()}
    searched = {preset: _meshes(devices, r) for preset, r in rules.items()} if meshes is None else {}
    allowed = {preset: set(found) for preset, found in searched.items()}
    deferred = []  # (mesh, preset, rules) of the presets after the first on pipelined meshes
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
            if preset is not presets[0] and mesh[3] > 1:
                deferred.append(work)
            else:
                search.mesh(*work)
    plan = Plan(cfg, devices, device_memory, host_memory, hardware, search.estimates)
    # A pipelined row ranks after every row that fits for certain (``Plan.ranked``): the other
    # presets' pipelines could not be first while a layout without a pipeline fits.
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
    choices, the estimates so far, and the caches ``estimate`` reads (per preset: the parameters'
    specs and what depends on the mesh and the ZeRO stage alone)."""

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
    tables: dict[tuple, SpecTables] = dataclasses.field(default_factory=dict)  # (preset, pipelined, ZeRO stage)
    memos: dict = dataclasses.field(default_factory=dict)  # preset -> ``estimate``'s memo
    rules: dict[tuple, ShardingRules] = dataclasses.field(default_factory=dict)  # (preset, pipelined) -> completed

    def add(self, est: Estimate) -> None:
        self.estimates.append(est)
        if self.progress is not None:
            self.progress(len(self.estimates))

    def mesh(self, mesh: tuple[int, int, int, int], preset: Preset | None, rules: ShardingRules) -> None:
        """Estimates the candidates of ``mesh`` under ``preset`` (None: the config's), laid out by ``rules``."""
        cfg = self.cfg
        data, fsdp, tensor, stage = mesh
        zeros = sorted(set(self.zero_stages)) if fsdp > 1 else [min(self.zero_stages)]  # no fsdp: stages equal
        ring = ring_axis(rules)
        if tensor > self.hardware.node_size or (stage > 1 and ring is not None and mesh[MESH_AXES.index(ring)] > 1):
            # Refused whatever the other choices: tensor parallelism's all-reduces run every layer,
            # so it is placed inside a node; ring attention does not run inside pipeline stages
            # (``Layout.problems``). One row says why (with the layout's other problems); nothing is estimated.
            candidate = Candidate(data, fsdp, tensor, stage, zeros[0], self.remats[0], preset=preset)
            layout = candidate_layout(cfg, candidate, rules, self.abstract_params)
            node = [f"tensor={tensor} spans more than a node of {self.hardware.node_size} (--node-size)"]
            self.add(Estimate(candidate, reasons=node[:tensor > self.hardware.node_size]
                              + [problem.reason for problem in layout.problems()]))
            return
        dp = data_parallel_size(rules, dict(zip(MESH_AXES, mesh)))
        rows = cfg.train.batch_size // (dp * cfg.train.grad_accum)
        micros = [cfg.pipeline.microbatches]
        if stage > 1:
            micros = [m for m in (stage, 2 * stage, 4 * stage, 8 * stage) if rows and rows % m == 0] or micros
        pipelines = _schedules(cfg, stage, self.schedules) if stage > 1 else [(None, 1)]
        memo = self.memos.setdefault(preset, {})
        for zero, remat, micro, offload, (schedule, virtual) in itertools.product(zeros, self.remats, micros,
                                                                                   self.offloads, pipelines):
            first = self.estimate(Candidate(data, fsdp, tensor, stage, zero, remat, micro, offload,
                                            cfg.train.grad_accum, schedule, virtual, preset), rules, memo)
            self.add(first)
            if self.search_accumulation and not first.reasons and first.total > self.device_memory:
                # Too big for its activations' sake: the same step in more accumulation steps.
                doublings, accum = [], cfg.train.grad_accum * 2
                while _accumulation_divides(cfg.train.batch_size, dp, accum, micro, stage):
                    doublings.append(accum)
                    accum *= 2
                self.accumulate(first, doublings, rules, memo)

    def accumulate(self, first: Estimate, doublings: list[int], rules: ShardingRules, memo: dict) -> None:
        """The layout ``first``, too big, in the fewest of ``doublings`` accumulation steps (the global
        batch kept) that fits, found by bisection: the bytes fall as the accumulation grows (the
        activations of fewer rows at a time), past the accumulator that a second step adds. The
        doublings tried are listed (those too big among them too); none when twice ``first``'s
        steps need no less memory (the state, not the activations, is too big)."""
        def at(steps: int) -> Estimate:
            return self.estimate(dataclasses.replace(first.candidate, grad_accum=steps), rules, memo)

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

    def estimate(self, candidate: Candidate, rules: ShardingRules, memo: dict) -> Estimate:
        """``estimate`` of ``candidate`` laid out by ``rules``, with the search's caches."""
        preset, pipelined, zero = candidate.preset, candidate.stage > 1, candidate.zero
        layout = candidate_layout(self.cfg, candidate, rules, self.abstract_params)
        # The family-completed rules depend on the preset and on whether there is a pipeline only:
        # filled in like ``Layout.of`` fills the graphdef (a fifth of the search's time).
        if (preset, pipelined) in self.rules:
            layout.__dict__["rules"] = self.rules[(preset, pipelined)]
        else:
            self.rules[(preset, pipelined)] = layout.rules
        if (preset, pipelined, zero) not in self.tables:
            self.tables[(preset, pipelined, zero)] = spec_tables(layout)
        return estimate(layout, candidate, compute_bytes=self.compute_bytes, hw=self.hardware,
                        specs=self.tables[(preset, pipelined, zero)], memo=memo)


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


def _gb(nbytes: float) -> str:
    """GB with 3 significant digits (``0.00352`` for tiny models, ``40.1`` for large ones)."""
    return f"{nbytes / GB:.3g}" if nbytes < 100 * GB else f"{nbytes / GB:.0f}"


def _preset(cfg: Config, candidate: Candidate) -> str:
    return (candidate.preset or cfg.sharding.preset).value


def _row(cfg: Config, rank: str, est: Estimate, verdict: str) -> list[str]:
    lay = est.candidate
    piped = lay.stage > 1 and est.in_flight
    return [rank, lay.label(), _preset(cfg, lay), str(lay.zero), lay.remat.value, str(lay.grad_accum),
            lay.schedule_label,
            str(lay.microbatches) if lay.stage > 1 else "-",
            f"{est.bubble:.1%}" if piped else "-", str(est.in_flight) if piped else "-",
            "yes" if lay.offload else "-", _gb(est.params), _gb(est.grads),
            _gb(est.optimizer),
            _gb(est.activations), _gb(est.temporaries + est.batch), _gb(est.update), _gb(est.total),
            _gb(est.optimizer_host) if lay.offload else "-", f"{est.step_s:.3g}", f"{est.compute_s:.3g}",
            f"{sum(est.comm_s.values()):.3g}", verdict]


HEADER = ["#", "mesh d,f,t,s", "preset", "zero", "remat", "acc", "schedule", "mb", "bubble", "flight", "offl", "params",
          "grads", "optim", "activ", "temps", "update", "total GB", "host GB", "step s", "comp s", "comm s", "verdict"]


LEFT_ALIGNED = {HEADER.index(name) for name in ("mesh d,f,t,s", "preset", "remat", "schedule", "verdict")}


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i in LEFT_ALIGNED else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows)


def format_plan(plan: Plan, top: int, show_infeasible: int) -> str:
    fit, big, broken = plan.ranked()
    m = plan.cfg.model
    hw = plan.hardware
    lines = [f"model: {family_of(m).name}, {m.num_params / 1e9:.2f}B parameters ({m.num_layers} layers, embed "
             f"{m.embed_dim}, vocab {m.vocab_size}); batch "
             f"{plan.cfg.train.batch_size} x {m.seq_len} tokens, grad_accum {plan.cfg.train.grad_accum}, "
             f"{plan.cfg.train.precision.value}, pipeline {plan.cfg.pipeline.schedule.value}",
             f"devices: {plan.devices} x {plan.device_memory / GB:.4g} GB"
             + (f", host {plan.host_memory / GB:.4g} GB per device" if plan.host_memory is not None else ""),
             f"roofline: {hw.peak_flops / 1e12:.0f} TFLOP/s per device, {hw.intra_node_bandwidth / GB:.0f} GB/s "
             f"inside a node of {hw.node_size}, {hw.inter_node_bandwidth / GB:.0f} GB/s across nodes; "
             "step = compute / (1 - bubble) + collectives (no overlap); bubble and flight (peak chunk "
             "activations a stage holds) from the pipeline schedule's table",
             f"layouts: {len(plan.estimates)} enumerated, {len(fit)} fit, {len(big)} need too much memory, "
             f"{len(broken)} cannot be built",
             "per device, GB, as XLA:CPU holds them (activ = what the backward keeps, in fp32; temps = the"
             " compute copy and the gradients the backward writes, then the larger of the loss phase and one"
             " layer's backward, and the batch; update = the fp32 gradients and one fp32 step per optimizer"
             " element, or an offloaded optimizer state's moments brought to the device; temp bytes = the"
             " larger of activ + temps and update; optim = resting on the device, host GB = offloaded):",
             ""]
    rows = [HEADER] + [_row(plan.cfg, str(i + 1), e, "fits" if plan.certain(e) else "fits?")
                       for i, e in enumerate(fit[:top])]
    rows += [_row(plan.cfg, "-", e, "; ".join(plan.problems(e))) for e in big[:show_infeasible]]
    if len(rows) > 1:
        lines.append(_table(rows))
    if any(not e.reliable for e in fit[:top]):
        lines.append(f"fits? = {UNRELIABLE}")
    if any(e.reliable and not plan.certain(e) for e in fit[:top]):
        lines.append(f"fits? (no pipeline) = fits only without the {TEMP_MARGIN:.0%} margin on temp bytes that the "
                     "estimate's largest measured error needs (XLA:CPU, scripts/plan_accuracy.py); confirm with "
                     "--verify")
    if broken and show_infeasible:
        seen: dict[str, str] = {}
        for est in broken:
            seen.setdefault(f"{est.candidate.label()} {_preset(plan.cfg, est.candidate)}: {'; '.join(est.reasons)}",
                            "")
        reasons = list(seen)
        lines.append(f"\ncannot be built ({len(reasons)} distinct, first {min(show_infeasible, len(reasons))}):")
        lines += [f"  {reason}" for reason in reasons[:show_infeasible]]
    return "\n".join(lines)


def _start_devices(count: int) -> None:
    """N simulated CPU devices for --verify, set before JAX's backends start."""
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass
    if len(jax.devices()) < count or jax.devices()[0].platform != "cpu":
        raise ConfigError("--verify", f"JAX already started with {len(jax.devices())} "
                          f"{jax.devices()[0].platform} devices; run the plan in a fresh process")


def verify(config_path: str | None, overrides: list[str], est: Estimate, devices: int) -> dict:
    """XLA's memory analysis of the real train step of ``est.candidate`` (AOT, abstract shapes)."""
    import jax

    from meshtrain.mesh import make_mesh
    from meshtrain.trainer import Trainer

    cfg = load_config(config_path, list(overrides) + est.candidate.overrides())
    mesh = make_mesh(cfg.mesh, jax.devices()[:devices])
    start = time.perf_counter()
    trainer = Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)
    analysis = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile() \
        .memory_analysis()
    return {"argument": analysis.argument_size_in_bytes, "output": analysis.output_size_in_bytes,
            "temp": analysis.temp_size_in_bytes, "seconds": time.perf_counter() - start}


def verified_verdict(xla: dict, device_memory: float) -> str:
    """The verdict XLA's memory analysis gives: arguments + temporaries (outputs alias the donated
    state) against the device memory. It overrules the estimate's."""
    needed = xla["argument"] + xla["temp"]
    return "fits" if needed <= device_memory else f"does not fit: XLA needs {needed / GB:.3g} GB"


def format_verify(results: list[tuple[Estimate, dict]], devices: int, device_memory: float,
                  cfg: Config | None = None) -> str:
    """The verify table; ``cfg`` names the preset of the rows that keep the config's (``-`` without it)."""
    def cell(estimated: float, measured: float) -> str:
        err = (estimated - measured) / measured if measured else float("nan")
        return f"{_gb(estimated)} / {_gb(measured)} ({err:+.1%})"

    rows = [["#", "mesh d,f,t,s", "preset", "zero", "remat", "mb", "argument GB est / xla", "output GB est / xla",
             "temp GB est / xla", "compile s", "verdict (xla)"]]
    for i, (est, xla) in enumerate(results):
        lay = est.candidate
        preset = _preset(cfg, lay) if cfg is not None else (lay.preset.value if lay.preset else "-")
        rows.append([str(i + 1), lay.label(), preset, str(lay.zero), lay.remat.value,
                     str(lay.microbatches) if lay.stage > 1 else "-", cell(est.argument_bytes, xla["argument"]),
                     cell(est.output_bytes, xla["output"]), cell(est.temp_bytes, xla["temp"]),
                     f"{xla['seconds']:.1f}", verified_verdict(xla, device_memory)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    return (f"\nverify: the real train step compiled ahead of time on {devices} simulated CPU devices "
            f"(XLA:CPU memory_analysis, per device):\n{table}")


def _plan(argv: list[str] | None) -> None:
    args = _parse_args(argv)
    if not 1 <= args.devices <= MAX_DEVICES:
        raise ConfigError("--devices", f"must be an integer in [1, {MAX_DEVICES:,}], got {args.devices:,}")
    for name in ("top", "show_infeasible", "verify", "node_size"):
        if getattr(args, name) < (1 if name in ("top", "node_size") else 0):
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be a positive integer, got "
                              f"{getattr(args, name)}")
    device_memory = parse_bytes(args.device_memory, "--device-memory")
    host_memory = None if args.host_memory is None else parse_bytes(args.host_memory, "--host-memory")
    peak = args.peak_tflops or peak_bf16_tflops(args.device_kind)
    if peak is None or peak <= 0:
        raise ConfigError("--device-kind", f"no peak FLOP/s known for {args.device_kind!r}; give --peak-tflops")
    hardware = Hardware(peak * 1e12, parse_bytes(args.intra_node_bandwidth, "--intra-node-bandwidth"),
                        parse_bytes(args.inter_node_bandwidth, "--inter-node-bandwidth"), args.node_size)
    meshes = None
    if args.mesh:
        meshes = [tuple(_parse_list(text, "--mesh", int)) for text in args.mesh]
        if any(len(m) != 4 or min(m) < 1 for m in meshes):
            raise ConfigError("--mesh", f"give four positive sizes data,fsdp,tensor,stage; got {args.mesh}")
    zeros = _parse_list(args.zero, "--zero", int)
    if not zeros or any(z not in (0, 1, 2, 3) for z in zeros):
        raise ConfigError("--zero", f"ZeRO stages are 0, 1, 2, 3; got {args.zero!r}")
    remats = _parse_list(args.remat, "--remat", RematPolicy)
    schedules = None if args.schedule is None else _parse_list(args.schedule, "--schedule", Schedule)
    if schedules is not None and (not schedules or Schedule.CUSTOM in schedules):
        raise ConfigError("--schedule", f"give some of gpipe, 1f1b, interleaved, zb_h1; got {args.schedule!r}")
    presets = None if args.preset is None else _parse_list(args.preset, "--preset", Preset)
    if presets is not None and not presets:
        raise ConfigError("--preset", f"give some of {', '.join(p.value for p in Preset)}; got {args.preset!r}")
    if args.verify:
        _start_devices(args.devices)
    cfg = load_config(args.config, args.overrides)
    plan = make_plan(cfg, args.devices, device_memory, host_memory, hardware=hardware, meshes=meshes,
                     zero_stages=zeros, remats=remats, schedules=schedules,
                     presets=search_presets(cfg) if presets is None else presets,
                     progress=(progress := ProgressLine()))
    progress.finish()
    print(format_plan(plan, args.top, args.show_infeasible), flush=True)
    if args.write_config:
        write_config(plan, args.config, args.overrides, pathlib.Path(args.write_config))
    if args.verify:
        best = plan.ranked()[0][:args.verify]
        results = [(est, verify(args.config, args.overrides, est, args.devices)) for est in best]
        print(format_verify(results, args.devices, device_memory, cfg))


class ProgressLine:
    """The search's progress on stderr, for a search longer than a second: one line rewritten in
    place on a terminal (else a line every 2 s), ``planning: N layouts estimated (T s)``."""

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.shown = False

    def __call__(self, count: int) -> None:
        now = time.perf_counter()
        interval = 0.2 if sys.stderr.isatty() else 2.0
        if now - self.started < 1.0 or now - self.last < interval:
            return
        self.last = now
        end = "\r" if sys.stderr.isatty() else "\n"
        print(f"planning: {count:,} layouts estimated ({now - self.started:.1f} s)", end=end, file=sys.stderr,
              flush=True)
        self.shown = True

    def finish(self) -> None:
        """Ends a rewritten line (so that what follows starts on its own)."""
        if self.shown and sys.stderr.isatty():
            print(file=sys.stderr, flush=True)


def write_config(plan: Plan, config: str | None, overrides: list[str], path: pathlib.Path) -> None:
    """Writes ``config`` with ``overrides`` and the best layout of ``plan`` applied (its mesh, ZeRO
    stage, remat, accumulation, microbatches, offload) to ``path`` as YAML that ``meshtrain.train
    --config`` runs as is; a one-line error, nothing written, when no layout fits."""
    fit = plan.ranked()[0]
    if not fit:
        raise ConfigError("--write-config", f"no layout fits on {plan.devices} devices; nothing written to {path}")
    if path.is_dir():
        raise ConfigError("--write-config", f"{path} is a directory; give a file name")
    chosen = load_config(config, [*overrides, *fit[0].candidate.overrides()])
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.write_text(yaml.safe_dump(to_dict(chosen), sort_keys=False))
        temporary.replace(path)
    except OSError as error:
        raise ConfigError("--write-config", f"cannot write {path}: {error.strerror}") from None
    print(f"wrote {path}: layout 1, {' '.join(fit[0].candidate.overrides())}", flush=True)


def main(argv: list[str] | None = None) -> int:
    return run(_plan, argv)


if __name__ == "__main__":
    sys.exit(main())
