"""``python -m meshtrain.plan`` as a command: pipeline layouts whose temp memory is estimated loosely
are marked ``fits?`` and ``--verify``'s compiled verdict overrules the estimate, a plugin family is
planned, and the device count is capped; ``--gpu`` plans on a compile target's figures, a question
nothing fits gets the first single change that does, a comm-bound step is marked, and an offloaded
optimizer verified on XLA:CPU is judged without its host bytes.
"""

from __future__ import annotations

import re

import pytest

from utils import REPO, TINY


def test_pipeline_verdicts_are_marked_and_verify_overrules(capsys):
    """meshtrain.plan ranked pipeline layouts as "fits" that its own --verify measured at several times
    the estimate: those the accuracy matrix does not hold (here a pipeline whose stages split the
    sequence, ``fsdp_tp_sp``) are marked, and the compiled verdict is printed beside the estimate."""
    from meshtrain import plan as planner
    from meshtrain.config import load_config
    from meshtrain.parallel.rules import Preset

    plan = planner.make_plan(load_config(TINY), 8, 80e9, meshes=[(1, 2, 2, 2), (2, 2, 2, 1)], zero_stages=[3],
                             remats=[planner.RematPolicy.FULL], presets=[Preset.FSDP_TP_SP])
    text = planner.format_plan(plan, top=10, show_infeasible=0)
    rows = {line.split()[1]: line for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert rows["(1,2,2,2)"].rstrip().endswith("fits?") and rows["(2,2,2,1)"].rstrip().endswith("fits")
    assert "fits? = pipeline temp memory is estimated within" in text and "--verify" in text
    est = next(e for e in plan.estimates if e.candidate.stage == 2)
    measured = {"argument": 1e9, "output": 1e9, "temp": 90e9, "seconds": 1.0}  # what XLA could report
    assert planner.verified_verdict(measured, 80e9) == "does not fit: XLA needs 91 GB"
    assert "does not fit: XLA needs 91 GB" in planner.format_verify([(est, measured)], 8, 80e9)


def test_the_plan_cli_plans_a_plugin_family(capsys):
    from meshtrain import plan as planner

    toy = str(REPO / "tests" / "toy_gpt.yaml")
    assert planner.main(["--config", toy, "--devices", "8", "--device-memory", "1GB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: toy_gpt, ") and "fits" in out


def test_plan_devices_are_capped(capsys):
    from meshtrain import plan

    assert plan.main(["--config", TINY, "--devices", str(10 ** 12), "--device-memory", "80GB"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: --devices: must be an integer in [1, 1,048,576], got 1,000,000,000,000"


def test_gpu_sets_the_roofline_and_memory_from_the_compile_tools_targets(monkeypatch):
    """``--gpu b200`` plans with the B200's dense bf16 peak, NVLink and inter-node bandwidths and what
    JAX's allocator takes of its spec's memory; each flag overrides one figure; no ``--gpu``: an H100's."""
    from meshtrain import plan
    from meshtrain.gpu_compile import Target
    from meshtrain.planner.roofline import Hardware

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    args = lambda *extra: plan._parse_args(["--devices", "8", *extra])
    assert plan.hardware_of(args("--gpu", "b200"), Target.B200) == Hardware(2250e12, 900e9, 50e9, 8)
    assert plan.hardware_of(args("--gpu", "h200"), Target.H200) == Hardware(989e12, 450e9, 50e9, 8)
    assert plan.hardware_of(args("--peak-tflops", "500", "--inter-node-bandwidth", "25GB"), Target.B200) == \
        Hardware(500e12, 900e9, 25e9, 8)
    assert plan.hardware_of(args("--device-memory", "80GB"), None) == Hardware(989e12, 450e9, 50e9, 8)
    assert plan.device_memory_of(None, Target.H200)[0] == 151397597184 * 0.75
    assert plan.device_memory_of("40GB", Target.H200) == (40e9, "")


def test_gpu_plans_on_its_memory_and_says_where_it_comes_from(capsys, monkeypatch):
    from meshtrain import plan

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert plan.main(["--config", TINY, "--devices", "8", "--gpu", "H100", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "devices: 8 x 63.71 GB (h100: 84.94 GB x 0.75 for JAX's allocator" in out, out
    assert "roofline: 989 TFLOP/s per device, 450 GB/s inside a node of 8, 50 GB/s across nodes" in out


@pytest.mark.parametrize("argv, line", [
    (["--gpu", "a100"], "error: --gpu: unknown GPU 'a100'; use one of h100, h200, b200"),
    ([], "error: --device-memory: give the memory per device (e.g. 80GiB) or --gpu (h100, h200, b200)"),
])
def test_a_bad_or_missing_gpu_is_one_line(capsys, argv, line):
    from meshtrain import plan

    assert plan.main(["--config", TINY, "--devices", "8", *argv]) == 2
    assert capsys.readouterr().err.strip() == line


def test_when_nothing_fits_the_plan_names_a_change_that_fits_and_verifies_nothing(capsys):
    """Tiny on 8 devices of 600 kB (XLA:CPU's constants, as --verify on the CPU takes): no layout fits,
    the optimizer offload alone still needs 642 kB, half the sequence fits; planned with that change,
    the estimate says it fits."""
    from meshtrain import plan
    from meshtrain.config import load_config
    from meshtrain.planner.constants import Compiler
    from meshtrain.planner.roofline import Hardware

    argv = ["--config", TINY, "--devices", "8", "--device-memory", "600kB", "--verify", "1", "--top", "1"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"layouts: \d+ enumerated, 0 fit, ", out), out
    assert "\nnothing fits; the first single change that does (gradient accumulation is searched already): " \
           "model.seq_len=32: (" in out, out
    assert "tried before it, still too big: offload (--host-memory): 0.000642 GB" in out
    assert out.rstrip().endswith("verify: nothing to verify: no layout fits")
    hardware = Hardware(compiler=Compiler.XLA_CPU)
    search = lambda cfg: plan.make_plan(cfg, 8, 600e3, hardware=hardware, presets=plan.search_presets(cfg))
    shorter = search(load_config(TINY, ["model.seq_len=32"]))
    assert not search(load_config(TINY)).ranked()[0]
    assert shorter.ranked()[0] and shorter.ranked()[0][0].total <= 600e3


def test_a_layout_whose_collectives_outlast_its_compute_is_marked_comm_bound():
    """Tiny over fsdp=8: at 450 GB/s its step is mostly collectives (comm s > comp s, marked ``*`` with
    the legend); on links a million times faster it is not, and nothing is marked."""
    from meshtrain import plan as planner
    from meshtrain.config import load_config
    from meshtrain.planner.roofline import Hardware

    def table(hardware):
        plan = planner.make_plan(load_config(TINY), 8, 80e9, hardware=hardware, meshes=[(1, 8, 1, 1)],
                                 zero_stages=[3], remats=[planner.RematPolicy.FULL])
        (est,) = plan.estimates
        return est, planner.format_plan(plan, top=1, show_infeasible=0)

    slow, slow_text = table(Hardware())
    fast, fast_text = table(Hardware(intra_node_bandwidth=450e15, inter_node_bandwidth=50e15))
    assert sum(slow.comm_s.values()) > slow.compute_s > sum(fast.comm_s.values()) > 0
    (row,) = [line.split() for line in slow_text.splitlines() if line.startswith("1  (1,8,1,1)")]
    assert row[-2:] == [f"{sum(slow.comm_s.values()):.3g}*", "fits"], row
    assert "* (comm s) = comm-bound: the estimated collectives take longer than the compute" in slow_text
    assert "*" not in fast_text


def test_an_offloaded_optimizer_verified_on_xla_cpu_is_judged_without_its_host_bytes():
    """XLA:CPU has no host memory space: its arguments hold the offloaded moments (``host``). The
    verdict leaves them out: 20 + 24.9 - 10 GB fits 40 GB (counted, 44.9 GB did not), and the verify
    table says why; XLA:GPU's own peak is taken as it is."""
    from meshtrain import plan as planner
    from meshtrain.config import load_config

    xla = {"argument": 20e9, "output": 20e9, "temp": 24.9e9, "host": 10e9, "seconds": 1.0}
    assert planner.verified_peak(xla) == 34.9e9 and planner.verified_verdict(xla, 40e9) == "fits"
    assert planner.verified_verdict({**xla, "host": 0}, 40e9) == "does not fit: XLA needs 44.9 GB"
    assert planner.verified_peak({**xla, "peak": 50e9}) == 50e9
    plan = planner.make_plan(load_config(TINY), 8, 80e9, 1e12, meshes=[(1, 8, 1, 1)], zero_stages=[3],
                             remats=[planner.RematPolicy.FULL])
    est = next(e for e in plan.estimates if e.candidate.offload)
    text = planner.format_verify([(est, xla)], 8, 40e9)
    assert "XLA:CPU's peak = argument + temp less the optimizer moments an offloaded layout keeps on the host" in text
    assert "argument + temp less" not in planner.format_verify([(est, {**xla, "host": 0})], 8, 40e9)


@pytest.mark.slow
def test_xla_cpu_counts_the_offloaded_moments_among_its_arguments():
    """The real train step of tiny with its optimizer offloaded, compiled by XLA:CPU: its argument
    bytes hold the moments the estimate places on the host, which ``verify`` reports as ``host``."""
    from meshtrain import plan as planner
    from meshtrain.config import load_config
    from meshtrain.planner.constants import Compiler
    from meshtrain.planner.roofline import Hardware

    plan = planner.make_plan(load_config(TINY), 8, 80e9, 1e12, meshes=[(1, 8, 1, 1)], zero_stages=[3],
                             remats=[planner.RematPolicy.FULL], hardware=Hardware(compiler=Compiler.XLA_CPU))
    est = next(e for e in plan.estimates if e.candidate.offload)
    xla = planner.verify(TINY, [], est, 8)
    assert xla["host"] == est.optimizer_host > 0
    assert xla["argument"] == pytest.approx(est.argument_bytes, rel=0.01)  # the host bytes among them
    assert planner.verified_peak(xla) == xla["argument"] + xla["temp"] - est.optimizer_host


def test_verify_compiles_for_the_gpu_named_and_says_why_not_without_one(monkeypatch):
    """With the GPU compile environment installed, ``--verify`` without ``--gpu`` compiles on XLA:CPU
    and says that no --gpu was given (``--device-kind`` no longer picks the target)."""
    from meshtrain import plan

    started = []
    monkeypatch.setattr(plan, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(plan, "_start_devices", started.append)
    assert plan.start_verify(8, None, 8) == (None, "no --gpu given (h100, h200, b200)") and started == [8]
