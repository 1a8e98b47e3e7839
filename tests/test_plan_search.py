"""meshtrain.plan's search dimensions beyond the mesh: the sharding preset (sequence parallelism,
context parallelism by all-gather and by ring) and the placement of tensor parallelism inside a
node (``--node-size``). Compile-free but for one run of the written config on 8 simulated devices."""

from __future__ import annotations

import pathlib

import pytest

from meshtrain import plan as planner
from meshtrain.config import load_config
from meshtrain.planner import search as plan_search
from meshtrain.planner.estimate import Candidate
from meshtrain.planner.roofline import Hardware
from meshtrain.parallel.rules import Preset
from models.common import RematPolicy

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
GB = 1e9
# The tiny Llama with rows long enough for the context-parallel presets (and heads for tensor 4).
LONG_TINY = ["model.seq_len=8192", "train.batch_size=8", "model.num_kv_heads=4"]
FAST = dict(zero_stages=[3], remats=[RematPolicy.FULL], search_accumulation=False)


def _presets_tried(plan) -> dict[tuple[int, int, int, int], set]:
    """Per mesh, the presets its candidates were laid out by (None: the config's)."""
    tried: dict = {}
    for est in plan.estimates:
        c = est.candidate
        tried.setdefault((c.data, c.fsdp, c.tensor, c.stage), set()).add(c.preset)
    return tried


def test_long_rows_add_the_context_parallel_presets_and_short_rows_do_not():
    short = load_config(TINY)
    long = load_config(TINY, LONG_TINY)
    assert planner.search_presets(short) == [Preset.FSDP_TP, Preset.FSDP_TP_SP]
    assert planner.search_presets(long) == [Preset.FSDP_TP, Preset.FSDP_TP_SP, Preset.FSDP_CP, Preset.FSDP_TP_CP,
                                            Preset.FSDP_CP_RING]
    assert planner.LONG_SEQUENCE == 8192
    assert planner.search_presets(load_config(TINY, ["model.seq_len=4096"])) == [Preset.FSDP_TP, Preset.FSDP_TP_SP]
    # A config of another family of presets keeps its own.
    assert planner.search_presets(load_config(TINY, ["sharding.preset=dp"])) == [Preset.DP]

    short_plan = planner.make_plan(short, 8, GB, presets=planner.search_presets(short), **FAST)
    assert {p for presets in _presets_tried(short_plan).values() for p in presets} == {None, Preset.FSDP_TP_SP}
    long_plan = planner.make_plan(long, 8, GB, presets=planner.search_presets(long), **FAST)
    tried = _presets_tried(long_plan)
    assert {p for presets in tried.values() for p in presets} == {None, *planner.search_presets(long)[1:]}
    # Each preset where it splits something the others do not: SP where tensor > 1, CP where fsdp > 1,
    # fsdp_cp (no tensor split) only on tensor = 1, fsdp_tp_cp (= fsdp_cp there) only where tensor > 1.
    assert tried[(8, 1, 1, 1)] == {None}
    assert tried[(4, 1, 2, 1)] == {None, Preset.FSDP_TP_SP}
    assert tried[(1, 8, 1, 1)] == {None, Preset.FSDP_CP, Preset.FSDP_CP_RING}
    assert tried[(2, 2, 2, 1)] == {None, Preset.FSDP_TP_SP, Preset.FSDP_TP_CP}
    # Without ``presets`` (the API's default) the config's own only.
    assert {p for presets in _presets_tried(planner.make_plan(long, 8, GB, **FAST)).values() for p in presets} == {None}


def test_the_preset_flag_restricts_the_search_and_shows_in_its_column(capsys):
    assert planner.main(["--config", str(TINY), "--devices", "8", "--device-memory", "1GB", "--zero", "3",
                         "--remat", "full", "--preset", "fsdp_cp_ring,fsdp_cp", "--top", "100",
                         "--show-infeasible", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#  mesh"))
    assert header.split()[:4] == ["#", "mesh", "d,f,t,s", "preset"]
    rows = [line.split() for line in lines if line.lstrip()[:1].isdigit() and "  (" in line]
    assert rows and {row[2] for row in rows} == {"fsdp_cp", "fsdp_cp_ring"}
    refused = [line for line in lines if line.startswith("  (")]
    assert refused and all(line.split()[1].rstrip(":") in ("fsdp_cp", "fsdp_cp_ring") for line in refused)
    # The ring runs inside pipeline stages: none is refused for it.
    assert not [line for line in refused if "ring attention" in line]
    # The second preset's pipelines are not searched: layouts without a pipeline fit, and rank first.
    assert not [row for row in rows if row[2] == "fsdp_cp" and not row[1].endswith(",1)")]


def test_the_other_presets_pipelines_are_searched_when_nothing_fits_without_a_pipeline():
    """The first preset is searched on every mesh; the others on pipelined meshes only when no
    layout without a pipeline fits (a pipelined row would rank after it)."""
    cfg = load_config(TINY, LONG_TINY)
    kwargs = dict(presets=planner.search_presets(cfg), **FAST)
    with_flat = _presets_tried(planner.make_plan(cfg, 8, GB, meshes=[(2, 2, 1, 2), (2, 2, 2, 1)], **kwargs))
    assert with_flat[(2, 2, 1, 2)] == {None} and Preset.FSDP_TP_CP in with_flat[(2, 2, 2, 1)]
    # Pipelined meshes only: every preset that splits something else there (SP: nothing at tensor 1;
    # fsdp_tp_cp: fsdp_cp's split), the ring among them (it runs inside stages).
    alone = planner.make_plan(cfg, 8, GB, meshes=[(2, 2, 1, 2)], **kwargs)
    assert _presets_tried(alone)[(2, 2, 1, 2)] == {None, Preset.FSDP_CP, Preset.FSDP_CP_RING}
    for preset in (Preset.FSDP_CP, Preset.FSDP_CP_RING):
        assert any(alone.fits(e) for e in alone.estimates if e.candidate.preset is preset), preset


@pytest.mark.parametrize("argv", [["--preset", "fsdp_xx"], ["--preset", ","]])
def test_a_bad_preset_is_one_line_and_exit_2(capsys, argv):
    assert planner.main(["--config", str(TINY), "--devices", "8", "--device-memory", "1GB", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --preset: ") and "\n" not in err


def test_a_context_parallel_candidate_configures_the_context_parallel_rules():
    """``Candidate.overrides`` names the preset; the config they make lays out CP as ``candidate_layout``
    does: positions over fsdp, rows over data only; the config's own ``sharding.rules`` kept."""
    candidate = Candidate(2, 4, 1, 1, 3, RematPolicy.FULL, preset=Preset.FSDP_CP)
    assert candidate.overrides()[-1] == "sharding.preset=fsdp_cp"
    assert "sharding.preset" not in " ".join(Candidate(2, 4, 1, 1, 3, RematPolicy.FULL).overrides())
    cfg = load_config(TINY, candidate.overrides())
    layout = cfg.layout(candidate.mesh)
    assert cfg.sharding.preset is Preset.FSDP_CP and layout.rules.name == "fsdp_cp"
    assert layout.length_ways == 4 and layout.batch_axes == ("data",) and layout.rules.ring_axis is None
    planned = plan_search.candidate_layout(load_config(TINY), candidate)
    assert planned.rules.table == layout.rules.table
    # The config's per-axis override (keys split like the queries: ring attention) is kept under the
    # candidate's preset, by the planner and by the config its overrides make.
    ring_keys = ["sharding.rules.kv_length={activations: fsdp}"]
    tp_cp = Candidate(1, 4, 2, 1, 3, RematPolicy.FULL, preset=Preset.FSDP_TP_CP)
    assert plan_search.candidate_layout(load_config(TINY, ring_keys), tp_cp).rules.ring_axis == "fsdp"
    assert load_config(TINY, ring_keys + tp_cp.overrides()).layout(tp_cp.mesh).rules.ring_axis == "fsdp"


@pytest.mark.parametrize("preset", ["fsdp_tp_sp", "fsdp_tp_cp"])
def test_write_config_writes_the_rows_preset(tmp_path, capsys, preset):
    out = tmp_path / "planned.yaml"
    assert planner.main(["--config", str(TINY), "--devices", "8", "--device-memory", "1GB", "--mesh", "2,2,2,1",
                         "--zero", "3", "--remat", "full", "--preset", preset, "--write-config", str(out)]) == 0
    written = capsys.readouterr().out.strip().splitlines()[-1]
    assert written.startswith(f"wrote {out}: layout 1, ") and written.endswith(f"sharding.preset={preset}")
    assert load_config(out).sharding.preset is Preset(preset)
    # The config's own preset among those given: its rows write no preset, the config keeps its own.
    assert planner.main(["--config", str(TINY), "--devices", "8", "--device-memory", "1GB", "--mesh", "8,1,1,1",
                         "--preset", f"fsdp_tp,{preset}", "--write-config", str(out), "--overwrite"]) == 0
    assert "sharding.preset" not in capsys.readouterr().out and load_config(out).sharding.preset is Preset.FSDP_TP


@pytest.mark.slow  # the fast tier's written config: tests/test_plan.py
def test_the_written_context_parallel_config_trains(tmp_path, capsys):
    """``plan --preset fsdp_cp --write-config`` then ``train --config`` of the file on the 8 simulated
    devices: the run lays out the plan's first row under context parallelism (positions over fsdp 4;
    the best row on any mesh is pure data parallelism, which CP leaves alone)."""
    from meshtrain.train import main as train_main

    out = tmp_path / "planned.yaml"
    assert planner.main(["--config", str(TINY), "--devices", "8", "--device-memory", "1GB", "--preset", "fsdp_cp",
                         "--mesh", "2,4,1,1", "--remat", "full", "--write-config", str(out), "train.steps=2"]) == 0
    assert "sharding.preset=fsdp_cp" in capsys.readouterr().out.strip().splitlines()[-1]
    cfg = load_config(out)
    assert cfg.sharding.preset is Preset.FSDP_CP and cfg.mesh.fsdp == 4
    assert train_main(["--config", str(out), f"run.dir={tmp_path / 'run'}", "checkpoint.every=0"]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"step"') == 2


def test_tensor_wider_than_a_node_is_refused_with_its_reason(capsys):
    cfg = load_config(TINY, LONG_TINY)
    plan = planner.make_plan(cfg, 8, GB, hardware=Hardware(node_size=2), presets=planner.search_presets(cfg), **FAST)
    wide = [e for e in plan.estimates if e.candidate.tensor > 2]
    assert wide and all(e.reasons[0] == f"tensor={e.candidate.tensor} spans more than a node of 2 (--node-size)"
                        for e in wide)
    # One row per mesh and preset; the narrower meshes are searched as before.
    assert len(wide) == len({(e.candidate.label(), e.candidate.preset) for e in wide})
    assert any(plan.fits(e) for e in plan.estimates if e.candidate.tensor == 2)
    # With the layout's own problems beside it; shown in the CLI's "cannot be built" list.
    (tp8,) = [e for e in wide if e.candidate.tensor == 8 and e.candidate.preset is None]
    assert "tensor=8 > kv_heads=4" in tp8.reasons[1:]
    assert planner.main(["--config", str(TINY), "--devices", "8", "--device-memory", "1GB", "--node-size", "2",
                         "--show-infeasible", "50"]) == 0
    out = capsys.readouterr().out
    assert "  (1,1,4,2) fsdp_tp: tensor=4 spans more than a node of 2 (--node-size); tensor=4 > kv_heads=2" in out


@pytest.mark.slow
def test_the_1024_device_search_over_the_presets_stays_bounded():
    """An 8B Llama of 8,192-position rows on 1,024 devices over the CLI's default presets (five): the
    layouts enumerated and the pipeline tables built stay bounded (scripts/bench_plan.py times it):
    the presets after the config's add no pipelined layout where one without a pipeline fits."""
    from meshtrain.parallel import schedules

    builders = (schedules.gpipe, schedules.one_f_one_b, schedules.interleaved_1f1b, schedules.zb_h1)
    for builder in builders:
        builder.cache_clear()
    cfg = load_config(REPO / "configs" / "llama_8b.yaml")
    plan = planner.make_plan(cfg, 1024, 141e9, presets=planner.search_presets(cfg))
    assert len(plan.estimates) <= 18000  # test_plan.py's bound for the config's preset alone
    assert [builder.cache_info().currsize <= 25 for builder in builders] == [True] * 4
    assert all(e.candidate.tensor <= 8 for e in plan.estimates if not e.reasons)
    fit, _, _ = plan.ranked()
    assert {est.candidate.preset for est in fit} == {None, *planner.search_presets(cfg)[1:]}
