"""meshtrain.plan: the analytic memory model against XLA's compiled memory analysis, the textbook
verdicts, infeasibility reasons and the CLI's bad input."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re

import pytest

from meshtrain import plan as planner
from meshtrain.config import load_config
from models.common import RematPolicy
from plan_checks import XLA_CPU, assert_state_matches, assert_temp_within

REPO = pathlib.Path(__file__).resolve().parents[1]
GB = 1e9
# (config, overrides, layout) cases: tiny (configs/tiny.yaml) and a small 4-layer variant.
SMALL = ["model.num_layers=4", "model.embed_dim=128", "model.mlp_dim=384", "model.vocab_size=256"]
CASES = {
    "dp8-zero0-none": ([], (8, 1, 1, 1), 0, "none", 1),
    "fsdp8-zero1-full": ([], (1, 8, 1, 1), 1, "full", 1),
    "fsdp8-zero2-dots": ([], (1, 8, 1, 1), 2, "dots", 1),
    "hybrid-zero3-none": ([], (2, 2, 2, 1), 3, "none", 1),
    "tp4-small-full": (SMALL + ["model.num_heads=8", "model.num_kv_heads=4"], (2, 1, 4, 1), 0, "full", 1),
    "pp2-small-gpipe": (SMALL, (1, 4, 1, 2), 3, "full", 4),
    "small-bf16-accum2": (SMALL + ["train.precision=bf16", "train.grad_accum=2"], (2, 4, 1, 1), 3, "dots", 1),
    # Replicated state and few tokens: the update, in place, adds no phase of its own.
    "small-zero0-inplace": (SMALL + ["train.batch_size=16"], (2, 4, 1, 1), 0, "dots", 1),
    # Long rows through the blockwise kernel (blocks of 512: one [512, 512] tile of scores at a time).
    "seq8k-dp8-none": (["model.seq_len=8192", "train.batch_size=8"], (8, 1, 1, 1), 0, "none", 1),
    "seq32k-fsdp8-full": (["model.seq_len=32768", "train.batch_size=8"], (1, 8, 1, 1), 3, "full", 1),
}


def _estimate_and_compile(overrides, mesh, zero, remat, micro):
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    plan = planner.make_plan(cfg, 8, 80 * GB, meshes=[mesh], zero_stages=[zero],
                             remats=[RematPolicy(remat)], schedules=[planner.Schedule.GPIPE], hardware=XLA_CPU)
    (est,) = [e for e in plan.estimates if e.candidate.microbatches == micro or mesh[3] == 1]
    assert not est.reasons, est.reasons
    xla = planner.verify(str(REPO / "configs" / "tiny.yaml"), overrides, est, 8)
    return est, xla


@functools.cache
def measured(name: str):
    """(estimate, XLA's memory analysis) of one case, compiled once per test process."""
    return _estimate_and_compile(*CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_state_and_temp_bytes_against_the_compiler(name):
    """State bytes exactly (within STATE_TOLERANCE), temp bytes within the stated tolerance."""
    assert_state_matches(*measured(name))
    assert_temp_within(name, *measured(name))


@pytest.mark.slow
def test_a_small_replicated_update_stays_below_its_backward_phase():
    """ZeRO-0 on a small model: XLA:CPU fuses the update into the writes of params and moments, so
    the temp is the backward phase's; the update phase the model counts (fp32 gradients + one fp32
    temporary per optimizer element, what XLA holds at 8B scale: tests/test_plan_accuracy.py) is
    below it, and XLA's temp stays well below the 16 B per parameter a select between the old and
    the new state would hold."""
    est, xla = measured("small-zero0-inplace")
    num_params = load_config(REPO / "configs" / "tiny.yaml", CASES["small-zero0-inplace"][0]).model.num_params
    assert est.update < est.backward_bytes and est.temp_bytes == est.backward_bytes
    assert est.temp_bytes == pytest.approx(xla["temp"], rel=0.10)
    assert xla["temp"] < 12 * num_params


def _plan(config, devices, memory, host=None, **kwargs):
    return planner.make_plan(load_config(REPO / "configs" / config, kwargs.pop("overrides", [])), devices,
                             memory, host, **kwargs)


def _only(plan, mesh, zero, remat="full"):
    matches = [e for e in plan.estimates if (e.candidate.data, e.candidate.fsdp, e.candidate.tensor, e.candidate.stage)
               == mesh and e.candidate.zero == zero and e.candidate.remat.value == remat]
    return min(matches, key=lambda e: e.total)


def test_10b_on_8x40gb_pure_dp_and_tp2_pp2_dp2_do_not_fit_and_zero3_does():
    plan = _plan("llama_10b.yaml", 8, 40 * GB)
    params = plan.cfg.model.num_params
    pure_dp = _only(plan, (8, 1, 1, 1), 0)
    # fp32 params + fp32 grads + fp32 Adam mu and nu: 16 bytes per parameter, 160 GB, on every device.
    assert pure_dp.params + pure_dp.grads + pure_dp.optimizer == pytest.approx(16 * params, rel=1e-6)
    assert not plan.fits(pure_dp)
    assert not plan.fits(_only(plan, (2, 1, 2, 2), 0))
    zero3 = _only(plan, (1, 8, 1, 1), 3)
    assert zero3.params + zero3.grads + zero3.optimizer == pytest.approx(16 * params / 8, rel=1e-6)
    assert plan.fits(zero3) and plan.problems(pure_dp)[0].startswith("needs ")


def test_7b_on_one_80gb_device_fits_no_layout_offload_brings_the_moments_back_for_the_update():
    without = _plan("llama_7b.yaml", 1, 80 * GB, hardware=XLA_CPU)
    offload = _plan("llama_7b.yaml", 1, 80 * GB, 1e12, hardware=XLA_CPU)
    assert not any(plan.fits(e) for plan in (without, offload) for e in plan.estimates)
    params = offload.cfg.model.num_params
    moved = [e for e in offload.estimates if e.candidate.offload]
    assert moved and all(e.optimizer == 0 and e.optimizer_host == pytest.approx(8 * params, rel=1e-6) for e in moved)
    # The update brings both moments of every leaf to the device: 8 B per parameter, the step's peak
    # under full remat; without offload it holds the fp32 gradients and one fp32 step per element.
    assert all(e.update == pytest.approx(8 * params, rel=1e-6) for e in moved)
    full = [e for e in moved if e.candidate.remat is RematPolicy.FULL]
    assert full and all(e.temp_bytes == e.update > e.backward_bytes for e in full)
    assert all(e.update == pytest.approx(8 * params, rel=1e-6) for e in without.estimates)


@pytest.mark.slow
def test_the_offloaded_7b_update_phase_matches_the_compiler():
    plan = _plan("llama_7b.yaml", 1, 80 * GB, 1e12, remats=[RematPolicy.FULL], hardware=XLA_CPU)
    (est,) = [e for e in plan.estimates if e.candidate.offload]
    xla = planner.verify(str(REPO / "configs" / "llama_7b.yaml"), [], est, 1)
    assert est.temp_bytes == pytest.approx(xla["temp"], rel=0.02)


@pytest.mark.slow
def test_70b_on_64x80gb_fits_with_zero3_and_a_smaller_batch():
    plan = _plan("llama_70b.yaml", 64, 80 * GB, overrides=["train.batch_size=64"])
    fit, _, _ = plan.ranked()
    # ZeRO-3 first (the one layout the estimate vouches for); with blockwise attention (no [seq, seq]
    # scores kept) lower stages fit too, on pipelines whose tensor x stage split leaves a device a
    # sixteenth of the layers' weights at most (16 B per parameter of 70B / 16 = 70 GB).
    assert fit and fit[0].candidate.zero == 3 and plan.certain(fit[0])
    assert all(e.candidate.zero == 3 or e.candidate.tensor * e.candidate.stage >= 16 for e in fit)


@pytest.mark.slow
def test_layouts_that_cannot_run_say_why():
    kwargs = dict(remats=[RematPolicy.FULL], zero_stages=[3])
    plan = _plan("llama_70b.yaml", 64, 80 * GB, meshes=[(1, 1, 16, 4), (1, 1, 2, 32)], **kwargs)
    three = _plan("llama_70b.yaml", 3, 80 * GB, meshes=[(1, 3, 1, 1)], **kwargs)
    reasons = {e.candidate.label(): "; ".join(e.reasons) for e in plan.estimates + three.estimates}
    assert "tensor=16 > kv_heads=8" in reasons["(1,1,16,4)"]
    assert "layers 80 not divisible by stage=32" in reasons["(1,1,2,32)"]
    assert "embed 8192 not divisible by fsdp=3" in reasons["(1,3,1,1)"]


def test_cli_prints_a_ranked_table(capsys):
    assert planner.main(["--config", str(REPO / "configs" / "llama_10b.yaml"), "--devices", "8",
                         "--device-memory", "40GB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    ranked = [line for line in out.splitlines() if re.match(r"[1-3]  \(\d+,\d+,\d+,\d+\) ", line)]
    assert len(ranked) == 3 and "fits" in out and "needs " in out, out


@pytest.mark.parametrize("argv, field", [
    (["--config", "configs/nope.yaml", "--devices", "8", "--device-memory", "80GB"], "--config"),
    (["--devices", "0", "--device-memory", "80GB"], "--devices"),
    (["--devices", "8", "--device-memory", "80XB"], "--device-memory"),
    (["--devices", "8", "--device-memory", "80GB", "--zero", "5"], "--zero"),
    (["--devices", "8", "--device-memory", "80GB", "mesh.tensr=2"], "mesh.tensr"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, field):
    assert planner.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {field}: ") and "\n" not in err


def test_memory_sizes_parse():
    assert planner.parse_bytes("80GiB", "x") == 80 * 2 ** 30
    assert planner.parse_bytes("40GB", "x") == 40e9
    assert planner.parse_bytes("1TiB", "x") == 2 ** 40


@pytest.mark.slow
def test_the_1024_device_search_stays_bounded():
    """An 8B Llama on 1,024 devices: the layouts the search enumerates (every pipeline schedule
    included), and the pipeline tables it builds to cost them (one per schedule shape: a layout that
    cannot be built builds none), are bounded; scripts/bench_plan.py times the answers (docs/memory.md)."""
    from meshtrain.parallel import schedules

    builders = (schedules.gpipe, schedules.one_f_one_b, schedules.interleaved_1f1b, schedules.zb_h1)
    for builder in builders:
        builder.cache_clear()
    plan = planner.make_plan(load_config("configs/llama_8b.yaml"), 1024, 141e9)
    assert len(plan.estimates) <= 20000
    # Tables built: 25 shapes (stages 2..16 x microbatches) per schedule today (interleaving refuses a
    # microbatch count that is not a multiple of the stages before building anything)
    assert [builder.cache_info().currsize <= 25 for builder in builders] == [True] * 4
    fit, _, _ = plan.ranked()
    assert fit and all(est.candidate.devices == 1024 for est in fit)
    assert {est.candidate.schedule for est in fit if est.candidate.stage > 1} == set(planner.Schedule) - {
        planner.Schedule.CUSTOM}


def test_the_search_tries_every_schedule_and_writes_the_chosen_one(tmp_path, capsys):
    """A 2-stage mesh of the 10B: one row per schedule (interleaving over 2 virtual stages), each
    with its own table's bubble; ``--schedule`` restricts the search; the written config names the
    first row's schedule."""
    plan = _plan("llama_10b.yaml", 8, 40 * GB, meshes=[(1, 2, 2, 2)], zero_stages=[3],
                 remats=[RematPolicy.FULL], search_accumulation=False)
    by_schedule = {(e.candidate.schedule, e.candidate.virtual_stages): e for e in plan.estimates
                   if e.candidate.microbatches == 4}
    assert set(by_schedule) == {(planner.Schedule.GPIPE, 1), (planner.Schedule.ONE_F_ONE_B, 1),
                                (planner.Schedule.INTERLEAVED, 2), (planner.Schedule.ZB_H1, 1)}
    bubbles = {schedule.value: est.bubble for (schedule, _), est in by_schedule.items()}
    assert bubbles["interleaved"] < bubbles["1f1b"] == bubbles["gpipe"] and bubbles["zb_h1"] < bubbles["1f1b"]
    assert by_schedule[(planner.Schedule.INTERLEAVED, 2)].candidate.overrides()[-2:] == [
        "pipeline.schedule=interleaved", "pipeline.virtual_stages=2"]
    out = tmp_path / "planned.yaml"
    # ZB-H1's cut holds every activation of two microbatches: 141 GB devices (40 GB do not fit it).
    assert planner.main(["--config", "configs/llama_10b.yaml", "--devices", "8", "--device-memory", "141GB",
                         "--mesh", "1,2,2,2", "--schedule", "zb_h1", "--write-config", str(out)]) == 0
    assert "zb_h1" in capsys.readouterr().out
    assert load_config(out).pipeline.schedule is planner.Schedule.ZB_H1


def test_the_written_config_trains_as_planned(tmp_path, capsys):
    """``plan --write-config`` then ``train --config`` of the written file on the 8 simulated devices:
    the run's mesh, ZeRO stage, remat and accumulation are the plan's first row."""
    from meshtrain.train import main as train_main

    out = tmp_path / "planned.yaml"
    assert planner.main(["--config", "configs/tiny.yaml", "--devices", "8", "--device-memory", "1GB",
                         "--write-config", str(out), "train.steps=2"]) == 0
    written = capsys.readouterr().out.strip().splitlines()[-1]
    assert written.startswith(f"wrote {out}: layout 1, mesh.data=")
    cfg = load_config(out)
    chosen = dict(item.split("=", 1) for item in written.split(", ", 1)[1].split())
    assert {f"mesh.{a}": str(getattr(cfg.mesh, a)) for a in ("data", "fsdp", "tensor", "stage")}.items() \
        <= chosen.items()
    assert chosen["zero.stage"] == str(cfg.zero.stage) and chosen["train.grad_accum"] == str(cfg.train.grad_accum)
    assert train_main(["--config", str(out), f"run.dir={tmp_path / 'run'}", "checkpoint.every=0"]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"step"') == 2


def test_write_config_when_nothing_fits_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "planned.yaml"
    assert planner.main(["--config", "configs/llama_70b.yaml", "--devices", "8", "--device-memory", "1GB",
                         "--write-config", str(out)]) == 2
    # Besides the progress lines a slow search prints (``ProgressLine``), one error line.
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("planning: ")]
    assert err == [f"error: --write-config: no layout fits on 8 devices; nothing written to {out}"]
    assert not out.exists()


def test_a_search_longer_than_a_second_shows_its_progress(capsys):
    """The CLI's progress line (on stderr, not a terminal here: a line every 2 s) for the 1,024-device
    search; ``make_plan`` reports each estimate to its ``progress`` callback."""
    counts = []
    plan = planner.make_plan(load_config("configs/tiny.yaml"), 8, 1e9, progress=counts.append)
    assert counts == list(range(1, len(plan.estimates) + 1))
    line = planner.ProgressLine()
    line.started -= 5.0  # as if the search had run 5 s
    line.last -= 5.0
    line(1234)
    assert capsys.readouterr().err.startswith("planning: 1,234 layouts estimated (5.0 s)")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["llama_8b", "qwen3_moe_30b_a3b"])
def test_the_written_big_config_shards_its_parameters_as_the_plans_first_row(tmp_path, capsys, config):
    """``plan --write-config`` for a cluster shape (64 x 141 GB), then ``train --print-sharding`` of the
    written file on 64 simulated devices (nothing compiled): the parameters' bytes per device equal
    the first row's ``params`` column (3 significant digits)."""
    import subprocess
    import sys

    out = tmp_path / "planned.yaml"
    devices = 64
    assert planner.main(["--config", f"configs/{config}.yaml", "--devices", str(devices), "--device-memory",
                         "141GB", "--top", "1", "--write-config", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    first = next(line for line in printed if line.startswith("1  ("))
    # The params column, right-aligned under its header (a schedule such as "interleaved x2" has a space).
    header = next(line for line in printed if line.startswith("#  mesh"))
    params_gb = float(first[:header.index(" params") + len(" params")].split()[-1])
    result = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", str(out), "--host-devices",
                             str(devices), "--print-sharding"], cwd=REPO, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    total = next(line for line in result.stdout.splitlines() if line.startswith("total"))
    per_device = int(total.split()[1])
    assert per_device / 1e9 == pytest.approx(params_gb, rel=5e-3), (first, total)


@pytest.mark.parametrize("memory,verdict", [("26.5GB", "fits?"), ("27.5GB", "fits")])
def test_a_layout_that_fits_only_within_the_models_error_is_not_vouched_for(memory, verdict, capsys):
    """The 10B's ZeRO-3 layout needs 25.8 GB by the estimate (an H100's, XLA:GPU's constants), 27.1 GB
    with its temp bytes ``TEMP_MARGIN`` (12%) larger: on 26.5 GB it fits, but only within the model's
    measured error, so it is ``fits?`` with the reason printed; on 27.5 GB it is ``fits``."""
    assert planner.main(["--config", str(REPO / "configs" / "llama_10b.yaml"), "--devices", "8", "--device-memory",
                         memory, "--mesh", "1,8,1,1", "--zero", "3", "--remat", "full"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("1  (1,8,1,1)")]
    assert row.split()[-1] == verdict and ("fits only without the 12% margin" in out) == (verdict == "fits?")


# ----- issue 53: --write-config refuses what it would overwrite; an asked-for mesh is shown -----

TINY_PLAN = ["--config", str(REPO / "configs" / "tiny.yaml"), "--devices", "8", "--device-memory", "1GB",
             "--mesh", "8,1,1,1", "--zero", "0", "--remat", "none"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_write_config_refuses_an_existing_file_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "planned.yaml"
    out.write_text("mine\n")
    assert planner.main([*TINY_PLAN, "--write-config", str(out)]) == 2
    assert _one_error_line(capsys) == (f"error: --write-config: {out} exists; pass --overwrite to replace it, "
                                       "or give a new file name")
    assert out.read_text() == "mine\n"
    assert planner.main([*TINY_PLAN, "--write-config", str(out), "--overwrite"]) == 0
    assert load_config(out).mesh.data == 8 and sorted(tmp_path.iterdir()) == [out]


def test_write_config_never_writes_onto_its_input_config(tmp_path, capsys):
    """Not even with --overwrite, and not under another spelling of the same file."""
    config = tmp_path / "config.yaml"
    config.write_text((REPO / "configs" / "tiny.yaml").read_text())
    before = config.read_text()
    argv = ["--config", str(config), *TINY_PLAN[2:], "--overwrite", "--write-config"]
    for target in (config, tmp_path / "." / "config.yaml"):
        assert planner.main([*argv, str(target)]) == 2
        assert _one_error_line(capsys) == (f"error: --write-config: {target} is the --config file; write the "
                                           "planned config to another file")
    assert config.read_text() == before


def test_write_config_never_writes_through_a_symbolic_link(tmp_path, capsys):
    target = tmp_path / "elsewhere.yaml"
    target.write_text("not the plan's\n")
    for link, points_to in ((tmp_path / "link.yaml", target), (tmp_path / "dangling.yaml", tmp_path / "nothing")):
        link.symlink_to(points_to)
        for extra in ([], ["--overwrite"]):
            assert planner.main([*TINY_PLAN, *extra, "--write-config", str(link)]) == 2
            assert _one_error_line(capsys) == (f"error: --write-config: {link} is a symbolic link; give the path "
                                               "of a regular file (nothing is written through a link)")
    assert target.read_text() == "not the plan's\n" and not (tmp_path / "nothing").exists()


def test_write_config_is_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    """The YAML goes to a new file in FILE's directory, renamed over FILE: a failed rename leaves the
    old FILE and no temporary file."""
    out = tmp_path / "planned.yaml"
    out.write_text("old\n")
    renames = []

    def failing_replace(source, destination):
        renames.append((pathlib.Path(source), pathlib.Path(destination)))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(planner.os, "replace", failing_replace)
    assert planner.main([*TINY_PLAN, "--overwrite", "--write-config", str(out)]) == 2
    assert _one_error_line(capsys) == f"error: --write-config: cannot write {out}: No space left on device"
    ((source, destination),) = renames
    assert source.parent == tmp_path and source != out and destination == out
    assert out.read_text() == "old\n" and sorted(tmp_path.iterdir()) == [out]


def _rows_of(out: str) -> list[tuple[str, str, str]]:
    """(rank, mesh, verdict's first word) of each row of the printed table."""
    return [(line.split()[0], line.split()[1], line.split("  ")[-1].split()[0]) for line in out.splitlines()
            if re.match(r"\s*(\d+|-)  \(\d+,\d+,\d+,\d+\) ", line)]


def test_a_mesh_asked_for_is_always_shown(capsys):
    """``--mesh 8,1,1,1 --mesh 1,8,1,1`` for the 10B on 8 x 40 GB: no layout of (8,1,1,1) fits, and
    (1,8,1,1)'s too-big ones are smaller: its best row is shown anyway, whatever --top. On tiny,
    (8,1,1,1)'s best fitting layout ranks third: shown with its rank under --top 2."""
    ten_b = ["--config", str(REPO / "configs" / "llama_10b.yaml"), "--devices", "8", "--device-memory", "40GB",
             "--mesh", "8,1,1,1", "--mesh", "1,8,1,1"]
    assert planner.main([*ten_b, "--top", "50"]) == 0
    rows = _rows_of(capsys.readouterr().out)
    assert ("-", "(8,1,1,1)", "needs") in rows and any(mesh == "(1,8,1,1)" for _, mesh, _ in rows), rows
    tiny = ["--config", str(REPO / "configs" / "tiny.yaml"), "--devices", "8", "--device-memory", "8MB",
            "--mesh", "8,1,1,1", "--mesh", "1,8,1,1", "--top", "2", "--show-infeasible", "0"]
    assert planner.main(tiny) == 0
    rows = _rows_of(capsys.readouterr().out)
    assert [rank for rank, _, _ in rows] == ["1", "2", "3"] and rows[2][1:] == ("(8,1,1,1)", "fits"), rows


def test_verify_without_the_gpu_compile_environment_compiles_on_xla_cpu_and_says_so(capsys, monkeypatch):
    """In .venv (no JAX CUDA plugin) ``--verify`` compiles on XLA:CPU's simulated devices, and its output
    says so and why; each row is compiled for those devices (``gpus`` None)."""
    asked = []

    def compiled(config, overrides, est, devices, gpus=None):
        asked.append((devices, gpus))
        return {"argument": est.argument_bytes, "output": est.output_bytes, "temp": est.temp_bytes, "seconds": 1.0}

    monkeypatch.setattr(planner, "verify", compiled)
    assert planner.main(["--config", str(REPO / "configs" / "tiny.yaml"), "--devices", "8", "--device-memory",
                         "80GB", "--mesh", "1,8,1,1", "--zero", "3", "--remat", "full", "--verify", "1"]) == 0
    out = capsys.readouterr().out
    assert asked == [(8, None)]
    assert "on 8 simulated CPU devices by XLA:CPU" in out and "by XLA:GPU" not in out, out
    assert "(XLA:CPU, not XLA:GPU: the GPU compile environment is not installed: make setup-gpu-compile" in out
    assert "per device, GB, as XLA:CPU holds them" in out  # the estimates compared are XLA:CPU's


def test_verify_reranks_by_xlas_verdict_and_shows_the_peak_beside_the_estimate():
    """Of two verified rows, the plan's first does not fit by XLA's peak and its second does: the second
    is listed first (``plan #`` 2), each with the estimate's total beside XLA's peak."""
    plan = planner.make_plan(load_config(REPO / "configs" / "tiny.yaml"), 8, 80 * GB, meshes=[(1, 8, 1, 1)],
                             zero_stages=[3], remats=[RematPolicy.FULL, RematPolicy.DOTS])
    first, second = plan.ranked()[0][:2]
    measured = [{"argument": 1e9, "output": 1e9, "temp": 1e9, "peak": 90e9, "seconds": 1.0},
                {"argument": 1e9, "output": 1e9, "temp": 1e9, "peak": 3e9, "seconds": 1.0}]
    text = planner.format_verify([(first, measured[0]), (second, measured[1])], 8, 80 * GB)
    rows = [line.split() for line in text.splitlines() if re.match(r"[12]  [12] ", line)]
    assert [(row[0], row[1], row[-1]) for row in rows] == [("1", "2", "fits"), ("2", "1", "GB")], text
    assert f"{planner._gb(second.total)} / 3 (" in text and "does not fit: XLA needs 90 GB" in text


def test_every_fitted_constant_says_where_it_was_measured():
    """The planner's constants: one table per compiler, each fitted field with its row (compiler,
    jaxlib, date) naming that compiler; GPUs take XLA:GPU's table, the simulated CPU devices XLA:CPU's."""
    from meshtrain.planner import constants
    from meshtrain.planner.roofline import Hardware

    assert set(constants.TABLES) == set(constants.Compiler)
    fitted = {f.name for f in dataclasses.fields(constants.Constants)} - {"compiler", "measured"}
    assert len(fitted) == 17, fitted
    for compiler, table in constants.TABLES.items():
        assert table.compiler is compiler and set(table.measured) == fitted
        assert {m.compiler for m in table.measured.values()} == {compiler.value}
        assert all(re.fullmatch(r"2026-1[12]-\d\d", m.date) for m in table.measured.values())
    assert {m.jaxlib for m in constants.XLA_CPU.measured.values()} == {"0.10.2"}
    assert {m.jaxlib for m in constants.XLA_GPU.measured.values()} == {"0.11.2"}
    assert Hardware().compiler is constants.Compiler.XLA_GPU
    # A run's own start-up estimate (meshtrain.loop) and gpu_check take the compiler of the devices they run on.
    assert [constants.Compiler.of_platform(p) for p in ('cpu', 'gpu')] == [constants.Compiler.XLA_CPU,
                                                                          constants.Compiler.XLA_GPU]
    # The terms that describe XLA:CPU alone (fp32 widening of bf16 values, copied loop carries) are XLA:CPU's.
    assert constants.XLA_CPU.held_bytes(2) == 4 and constants.XLA_GPU.held_bytes(2) == 2
    assert constants.XLA_CPU.copied_carries and not constants.XLA_GPU.copied_carries
    with pytest.raises(ValueError, match="measured must name every fitted field"):
        dataclasses.replace(constants.XLA_GPU, measured={})


def test_the_readmes_8_gpu_llama_8b_example_is_a_layout_the_planner_says_fits(monkeypatch):
    """README's one-node example (FSDP 4 x tensor 2, ZeRO-3, remat full, the config's preset) on 8 H100s
    as ``--gpu h100`` gives them: without accumulation it fits nowhere near; in the 16 steps the
    README's train command sets, the estimate vouches for it (``fits``, the first row)."""
    from meshtrain.gpu_compile import Target

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    memory, _ = planner.device_memory_of(None, Target.H100)
    plan = _plan("llama_8b.yaml", 8, memory, meshes=[(1, 4, 2, 1)], zero_stages=[3], remats=[RematPolicy.FULL])
    fit, big, _ = plan.ranked()
    assert fit[0].candidate.grad_accum == 16 and plan.certain(fit[0])
    assert all(e.candidate.grad_accum < 16 for e in big)
    readme = (REPO / "README.md").read_text()
    assert "llama_8b.yaml mesh.fsdp=-1 mesh.tensor=2 train.grad_accum=16 " in readme
