"""The benchmark scripts, the GPU check's CPU dry run (in ``make gpu-rehearsal``: ``rehearsal``) and
the recommended XLA flags keep working.

The scripts run as docs/benchmarks.md shows them (one subprocess each; the tests import nothing from
``scripts/``; the MaxText shapes' override tables, ``meshtrain.measure.maxtext``, are checked without
compiling). No timing assertions: the fields are printed, timings are positive, and every other
number is checked against something measured apart from it: the compiled programs' collectives,
XLA's memory analysis, the model's own parameter arrays, a stand-in MaxText's known step times.
"""

import dataclasses
import enum
import json
import os
import pathlib
import subprocess
import sys

import pytest
from compile_flags import FAST_COMPILE_XLA_FLAG

from meshtrain import xla_flags
from meshtrain.measure import maxtext
from meshtrain.measure.hlo import collective_counts, footprint_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIELDS = ("step_time_s_median", "tokens_per_sec", "tflops_per_device", "mfu", "compile_s",
          "memory_per_device", "collectives", "overhead_ratio", "guarded_overhead_ratio", "guard_ratio",
          "baseline", "baseline_guarded", "bytes_accessed", "guard_bytes")
NOT_INSTALLED = "maxtext: not installed (run scripts/install_maxtext.sh)"
# The planner's temp estimate against XLA:CPU's on the dry run's bf16 one-device step: docs/memory.md
# gives -29%..+9% on small layouts (this one: -22%, jax 0.10.2).
PLANNER_TOLERANCE = 0.3
# A stand-in for MaxText's python: records its arguments, logs every step as MaxText does, step 0
# (dispatch and compile) 9 s, every other step 0.3 s in float32 and 0.1 s in bfloat16.
FAKE_MAXTEXT = """#!/usr/bin/env bash
venv="$(cd "$(dirname "$0")/.." && pwd)"
steps=0 dtype=bfloat16
for arg in "$@"; do
  case "$arg" in steps=*) steps="${arg#steps=}" ;; dtype=*) dtype="${arg#dtype=}" ;; esac
done
printf '%s\\n' "$*" >> "$venv/calls"
seconds=0.100; [[ $dtype == float32 ]] && seconds=0.300
echo "Jax Version: stand-in"
for ((i = 0; i < steps; i++)); do
  s=$seconds; ((i == 0)) && s=9.000
  echo "I1201 metric_logger.py:265] completed step: $i, seconds: $s, TFLOP/s/device: 0.021, \\
Tokens/s/device: 271.877, total_weights: 2048, loss: 10.$i, lm_loss: 10.$i, perplexity: 52867.070"
done
"""


def _script(name: str, *args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python scripts/<name> args...`` from the repository root, this session's JAX settings inherited."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _json_line(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("json: "))


def _fake_maxtext(root: pathlib.Path) -> pathlib.Path:
    """A MaxText venv (``MAXTEXT_VENV``) whose python is FAKE_MAXTEXT; its calls go to ``calls``."""
    python = root / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_MAXTEXT)
    python.chmod(0o755)
    configs = root / "lib" / "python3.12" / "site-packages" / "maxtext" / "configs"
    configs.mkdir(parents=True)
    (configs / "base.yml").write_text("")
    return root


def _per_device_bytes(tree) -> int:
    """Bytes of one device's shards of an abstract pytree (shapes with shardings)."""
    import math

    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_bench_vs_baseline_prints_fields(tmp_path):
    from meshtrain.config import load_config
    from utils import trainer_of_config

    proc = _script("bench.py", "--config", "configs/tiny.yaml", "--host-devices", "8", "--steps", "2",
                   "--vs-baseline")
    result = _json_line(proc)
    for field in FIELDS:
        assert f"\n{field}: " in proc.stdout
    assert result["devices"] == 8 and result["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}
    assert result["mfu"] is None  # CPU: no known peak
    assert result["step_time_s_median"] > 0 and result["overhead_ratio"] > 0
    # The arguments are one device's shards of the state and the batch, as the trainer lays them out.
    trainer = trainer_of_config(load_config(ROOT / "configs/tiny.yaml"))
    state_and_batch = _per_device_bytes((trainer.abstract_state(), trainer.abstract_batch()))
    assert result["memory_per_device"]["argument_bytes"] == state_and_batch
    # Same init, same batch, same loss: the baseline's first step computes the same loss.
    assert result["baseline"]["loss_first"] == pytest.approx(result["loss_first"], rel=1e-5)
    assert result["baseline_guarded"]["loss_first"] == pytest.approx(result["loss_first"], rel=1e-5)
    # FSDP 2 x TP 2 x DP 2: the 9 layer weights gathered over fsdp in the forward and the backward
    # scan (18), the final norm's scale in both (2), the head and the token ids: 22 all-gathers; an
    # activation re-laid out at the layer's sharding constraint and its transpose: 2 all-to-alls.
    # The trainer's step compiles to the guarded hand-written step's collectives, the plain one's
    # plus the guard's scalar all-reduces (the norms' partial sums and the finite checks: 27 against
    # 19 on jax 0.10.2; XLA 0.11.2 combines them differently, 26 against 20).
    assert result["collectives"] == result["baseline_guarded"]["collectives"]
    assert {**result["collectives"], "all-reduce": None} == {
        "all-gather": 22, "all-reduce": None, "reduce-scatter": 0, "collective-permute": 0, "all-to-all": 2}
    plain = result["baseline"]["collectives"]
    assert plain == {**result["collectives"], "all-reduce": plain["all-reduce"]}
    assert 0 < result["collectives"]["all-reduce"] - plain["all-reduce"] <= 8, (result["collectives"], plain)
    # The guard's passes show in XLA's byte count: it reads every new parameter and moment (the
    # finite check) and the gradients (their norm): more than the donated state's bytes, less than
    # twice them (no copy of the state). meshtrain's step moves what the guarded hand-written one
    # moves (the scalar metrics aside): the trainer adds no pass of its own.
    plain, guarded = result["baseline"]["bytes_accessed"], result["baseline_guarded"]["bytes_accessed"]
    state = result["baseline"]["memory_per_device"]["alias_bytes"]
    assert state < result["guard_bytes"] < 2 * state, (result["guard_bytes"], state)
    assert plain < guarded and result["bytes_accessed"] == pytest.approx(guarded, rel=1e-3)
    # The update is in place and the check only reads its result: no second copy of the state.
    temp = {name: result[name]["memory_per_device"]["temp_bytes"] for name in ("baseline", "baseline_guarded")}
    temp["meshtrain"] = result["memory_per_device"]["temp_bytes"]
    assert temp["meshtrain"] == pytest.approx(temp["baseline"], rel=1e-3), temp
    assert temp["baseline_guarded"] == pytest.approx(temp["baseline"], rel=1e-3), temp


@pytest.mark.slow
def test_guarded_baseline_keeps_the_state_of_a_non_finite_step():
    """A NaN in one embedding entry makes the loss NaN: the guarded baseline returns params and
    optimizer state unchanged, the plain one applies the NaN update."""
    import jax
    import numpy as np
    from utils import make_trainer

    from meshtrain.measure.benchmark import baseline_step, random_batch

    trainer = make_trainer((2, 2, 2, 1))
    state = trainer.init_state(seed=0)
    poisoned_one = [False]

    def poison(path, x):
        if not poisoned_one[0] and "embed" in jax.tree_util.keystr(path) and x.ndim == 2:
            poisoned_one[0] = True
            return x.at[0, 0].set(np.nan)
        return x

    params = jax.tree_util.tree_map_with_path(poison, state.params)
    assert poisoned_one[0]
    opt_state = jax.device_put(state.opt_state, trainer.optimizer_compute_shardings)
    batch = random_batch(trainer)
    before = [np.asarray(x) for x in jax.tree.leaves((params, opt_state))]
    copies = lambda tree: jax.tree.map(lambda x: x.copy(), tree)  # the steps donate their inputs
    kept = baseline_step(trainer, guarded=True)(copies(params), copies(opt_state), batch)
    applied = baseline_step(trainer)(copies(params), copies(opt_state), batch)
    assert np.isnan(float(kept[2])) and np.isnan(float(applied[2]))
    for old, new in zip(before, jax.tree.leaves(kept[:2])):
        np.testing.assert_array_equal(np.asarray(new), old)
    assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(applied[0]))


@pytest.mark.slow
def test_bench_experts_counts_all_to_all_and_active_flops(tmp_path):
    """bench_experts.py: experts replicated (EP 1) need no all-to-all, EP 4 does; FLOPs per token are
    those of the active parameters (top_k experts), counted here from the model's own arrays."""
    from flax import nnx

    from meshtrain.config import load_config
    from models.api import family_of

    out = tmp_path / "experts.json"
    proc = _script("bench_experts.py", "--config", "configs/moe_tiny.yaml", "--host-devices", "8", "--steps", "1",
                   "--layouts", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    replicated, ep4 = json.loads(out.read_text())["results"]
    assert ep4["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}
    # EP 4: the expert buffers' dispatch and combine, forward and backward (the layer scan's body
    # appears once): 4; and an activation re-laid out at the layer's sharding constraint over fsdp
    # and its transpose: 2. Replicated experts: none.
    assert replicated["collectives"]["all-to-all"] == 0 and ep4["collectives"]["all-to-all"] == 6
    model = load_config(ROOT / "configs/moe_tiny.yaml").model
    # The matmul weights a token passes through: every array of two or more dimensions but the input
    # embedding and the (stacked) norm scales, the experts' at top_k / num_experts; PaLM's count
    # (docs/benchmarks.md): 6 per weight, and 12 * layers * seq_len * heads * head_dim for attention.
    active = 0
    for path, value in nnx.to_flat_state(nnx.split(family_of(model).build(model, seed=0))[1]):
        name, shape = ".".join(map(str, path)), value.get_value().shape
        if len(shape) >= 2 and name != "embedding" and not name.endswith(".scale"):
            experts = len(shape) == 4 and shape[1] == model.num_experts
            active += value.get_value().size * (model.top_k / model.num_experts if experts else 1)
    attention = 12 * model.num_layers * model.seq_len * model.num_heads * model.head_dim
    assert ep4["flops_per_token"] == pytest.approx(6 * active + attention)
    assert ep4["flops_per_token"] < 6 * model.num_params  # not every expert counted


def test_bench_experts_refuses_a_dense_config():
    proc = _script("bench_experts.py", "--config", "configs/tiny.yaml", "--steps", "1", timeout=300)
    assert proc.returncode == 1 and "no expert axes" in proc.stderr, proc.stderr[-2000:]


def test_hlo_readers():
    text = ("  %a = f32[4] all-gather(x)\n  %b = f32[4] all-reduce-start(y)\n  %d = f32[4] all-reduce-done(b)\n"
            "  %c = f32[4] add(x, y)\n")
    assert collective_counts(text) == {"all-gather": 1, "all-reduce": 1, "reduce-scatter": 0,
                                       "collective-permute": 0, "all-to-all": 0}
    memory = {"argument_bytes": 100, "output_bytes": 60, "alias_bytes": 50, "temp_bytes": 7}
    assert footprint_bytes(memory) == 117  # 100 + 60 - 50 + 7


@pytest.mark.slow  # the fast tier's benchmark scripts: the other tests here
def test_gpu_check_starts_no_phase_its_budget_cannot_hold():
    """Every cap is at least 20 s: with 10 s for the whole check each phase is skipped and says why
    (fp8 and offload: their throughput phase did not run), the table lists them all, exit 0."""
    env = {**os.environ, "PYTHON": sys.executable, "XLA_FLAGS": FAST_COMPILE_XLA_FLAG}
    proc = subprocess.run([str(ROOT / "scripts/gpu_check.sh"), "--dry-run", "--budget", "10"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    report = _json_line(proc)
    assert proc.returncode == 0, proc.stderr
    phases = ("loss_check", "throughput", "xla_flag_arms", "fp8", "compile_parity", "checkpoint", "packing", "moe",
              "deepseek", "attention_kernels", "pipeline", "offload", "overhead")
    assert all("skipped" in report[name] for name in phases)
    assert report["fp8"]["skipped"] == report["offload"]["skipped"] == report["xla_flag_arms"]["skipped"] \
        == report["compile_parity"]["skipped"] == "needs throughput"
    assert report["loss_check"]["skipped"].startswith("budget: ")
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["phase", "seconds", "cap", "result"])
    assert [line.split()[0] for line in lines[header + 1:header + 1 + len(phases)]] == list(phases)


def _gpu_check_dry_run() -> tuple[dict, str]:
    """``scripts/gpu_check.sh --dry-run``'s report and output: those of the run whose output
    ``GPU_CHECK_LOG`` holds (``make gpu-rehearsal``'s, on the GPU machine's package set), else of a run
    here (only the suite's compile-speed flag, tests/conftest.py; no simulated devices: one CPU device)."""
    log = os.environ.get("GPU_CHECK_LOG")
    if log:
        stdout = pathlib.Path(log).read_text()
        return json.loads(stdout.strip().splitlines()[-1].removeprefix("json: ")), stdout
    env = {**os.environ, "PYTHON": sys.executable, "XLA_FLAGS": FAST_COMPILE_XLA_FLAG}
    proc = subprocess.run([str(ROOT / "scripts/gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    return _json_line(proc), proc.stdout


@pytest.mark.rehearsal
def test_gpu_check_dry_run():
    report, stdout = _gpu_check_dry_run()
    assert report["dry_run"] and report["loss_check"]["passed"]
    assert report["throughput"]["tokens_per_sec"] > 0 and "mfu" in report["throughput"]
    planned = report["throughput"]["planner"]
    assert planned["xla_temp_bytes"] > 0 and not planned["reasons"]
    # The planner's estimate against the compiled step's own temp bytes.
    assert abs(planned["estimate_temp_bytes"] / planned["xla_temp_bytes"] - 1) < PLANNER_TOLERANCE, planned
    arms = report["xla_flag_arms"]  # the 1B shape's step under each flag set of meshtrain/xla_flags.py
    assert set(arms["arms"]) == {"fixed", "derived", "o1"} and arms["fastest"] in arms["arms"]
    assert all(arm["step_time_s_median"] > 0 and arm["compile_s"] > 0 for arm in arms["arms"].values())
    assert arms["arms"]["o1"]["optimization_level"] == "O1" and "xla flag arms: fastest" in stdout
    fp8 = report["fp8"]  # the 1B shape's fp8 step beside bf16's; 10 tiny steps fp8 vs bf16
    assert fp8["passed"] and fp8["speedup"] > 0 and set(fp8["final_loss"]) == {"bf16", "fp8"}
    assert "host_temp_bytes" in report["offload"]["memory_per_device"]
    # Device against deviceless needs a GPU card among the compile targets (and the CUDA plugin).
    assert report["compile_parity"]["skipped"].startswith("no compile-only target for 'cpu'")
    assert report["checkpoint"]["passed"] and report["checkpoint"]["bit_equal"]
    moe = report["moe"]
    assert moe["passed"] and set(moe["experts_ms"]) == {
        f"{shape}/{variant}" for shape in ("mixtral", "fine_grained")
        for variant in ("onehot", "capacity_1.25", "sorted_blocked", "sorted_ragged")}
    assert moe["ragged_dot"]["scaling"] > 0 and moe["ragged_dot"]["verdict"] in ("grouped", "dense over every group")
    deepseek = report["deepseek"]
    assert deepseek["passed"] and deepseek["greedy_tokens_equal"]
    assert set(deepseek["attention_ms"]) == {"blockwise", "xla"}
    kernels = report["attention_kernels"]
    assert kernels["passed"] and set(kernels["errors"]) == {"causal", "documents", "window", "packed_vs_alone"}
    assert [row["seq_len"] for row in kernels["timings"]] == [256]
    assert all(row["blockwise_s"] > 0 and row["xla_s"] > 0 and "cudnn_s" not in row for row in kernels["timings"])
    overhead = report["overhead"]
    # On one device as on eight: the guard adds bytes accessed, and meshtrain's step moves what the
    # guarded hand-written one moves.
    guarded, plain = overhead["baseline_guarded_bytes_accessed"], overhead["baseline_bytes_accessed"]
    assert overhead["guard_bytes"] > 0 and plain < guarded
    assert overhead["bytes_accessed"] == pytest.approx(guarded, rel=1e-3)
    assert all(overhead[key] > 0 for key in ("overhead_ratio", "guarded_overhead_ratio", "guard_ratio"))
    assert "TFLOP/s" in stdout and "MFU" in stdout
    assert "phase fp8: PASS" in stdout and "phase pipeline: PASS" in stdout


def test_xla_flags_keep_user_values():
    merged = xla_flags.merge_flags("--xla_gpu_enable_triton_gemm=true --foo=1", xla_flags.recommended_flags())
    assert "--xla_gpu_enable_triton_gemm=true" in merged and "--xla_gpu_enable_triton_gemm=false" not in merged
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in merged
    assert all(why for _, _, why in xla_flags.RECOMMENDED_GPU_FLAGS)


def test_xla_flags_not_applied_on_cpu(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    assert xla_flags.apply_recommended() == []  # the tests run with jax_platforms=cpu
    assert os.environ["XLA_FLAGS"] == ""


def test_xla_flags_known_to_xla():
    """An unknown flag aborts XLA at start-up: every recommended flag must parse in this jaxlib."""
    env = {**os.environ, "XLA_FLAGS": " ".join(xla_flags.recommended_flags()), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "3.0", proc.stderr[-2000:]


def test_pipelining_flags_follow_the_jaxlib_spelling():
    """jaxlib >= 0.11 spells collective pipelining as enums (the booleans are its deprecated aliases);
    0.10 knows only the booleans. test_xla_flags_known_to_xla parses the chosen set in this jaxlib
    (CI runs it on the oldest and the newest supported)."""
    why = "overlap"
    assert xla_flags.pipelining_flag("all_gather", why, (0, 10, 2)) == ("xla_gpu_enable_pipelined_all_gather",
                                                                         "true", why)
    assert xla_flags.pipelining_flag("reduce_scatter", why, (0, 11, 2)) == ("xla_gpu_pipeline_reduce_scatter",
                                                                             "on", why)
    chosen = {name for name, _, _ in xla_flags.RECOMMENDED_GPU_FLAGS}
    enums = xla_flags.jaxlib_version() >= xla_flags.PIPELINE_ENUMS_SINCE
    assert ("xla_gpu_pipeline_all_gather" in chosen) is enums
    assert ("xla_gpu_enable_pipelined_all_gather" in chosen) is not enums


def test_model_attention_picks_the_kernel():
    """model.attention reaches the kernel: auto (blockwise on CPU, blocks of 3 positions here) equals
    xla (dense) within 1e-5; cudnn on a CPU is a one-line error, not a fallback."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models.kernels.attention import AttentionKernel
    from models.llama import Llama, LlamaConfig

    tokens = jnp.arange(8, dtype=jnp.int32)[None] % 5
    logits = {kernel: Llama(LlamaConfig(attention=kernel, attention_block=3), rngs=nnx.Rngs(0))(tokens)
              for kernel in (AttentionKernel.AUTO, AttentionKernel.XLA)}
    np.testing.assert_allclose(logits[AttentionKernel.AUTO], logits[AttentionKernel.XLA], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cudnn needs an NVIDIA GPU"):
        Llama(LlamaConfig(attention=AttentionKernel.CUDNN), rngs=nnx.Rngs(0))(tokens)


def test_xla_flags_applied_for_gpu_runs(monkeypatch):
    monkeypatch.setattr(xla_flags, "gpu_run_expected", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    added = xla_flags.apply_recommended()
    assert len(added) == len(xla_flags.RECOMMENDED_GPU_FLAGS) - 1  # the user's value is kept
    assert os.environ["XLA_FLAGS"].startswith("--xla_gpu_enable_latency_hiding_scheduler=false ")
    monkeypatch.setenv(xla_flags.DISABLE_ENV, "0")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert xla_flags.apply_recommended() == [] and os.environ["XLA_FLAGS"] == ""


def test_vs_maxtext_not_installed(tmp_path):
    """Without MaxText's venv both MaxText scripts say so in one line and exit 0: no test needs MaxText."""
    env = {"MAXTEXT_VENV": str(tmp_path / "absent")}
    for script, args in (("bench_maxtext.py", ["--shape", "large"]), ("bench_vs_maxtext.py", [])):
        proc = _script(script, *args, env=env, timeout=300)
        assert proc.returncode == 0 and proc.stdout == f"{NOT_INSTALLED}\n", proc.stdout + proc.stderr[-2000:]


def test_bench_maxtext_reads_a_maxtext_log(tmp_path):
    """bench_maxtext.py against the stand-in: MaxText gets the shape as its overrides, the warm-up
    steps are dropped, the median and losses are read from the log lines."""
    venv = _fake_maxtext(tmp_path / "venv")
    out = tmp_path / "maxtext.json"
    proc = _script("bench_maxtext.py", "--shape", "issue", "--steps", "4", "--warmup", "1", "--json", str(out),
                   env={"MAXTEXT_VENV": str(venv)}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["step_times_s"] == [0.1] * 4 and result["step_time_s_median"] == 0.1
    assert result["all_step_times_s"] == [9.0] + [0.1] * 4
    assert (result["loss_first"], result["loss_last"], result["jax"]) == (10.0, 10.4, "stand-in")
    (call,) = (venv / "calls").read_text().splitlines()
    assert {"base_emb_dim=256", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "per_device_batch_size=1",
            "remat_policy=full", "steps=5", "attention=dot_product", "dtype=bfloat16"} <= set(call.split())


# Each field of maxtext.Shape -> (meshtrain's config field it sets, MaxText's override key). A Shape
# field missing here fails the test below; a mapped field whose override is missing fails it too.
SHAPE_FIELDS = {
    "embed": ("model.embed_dim", "base_emb_dim"), "layers": ("model.num_layers", "base_num_decoder_layers"),
    "mlp": ("model.expert_mlp_dim", "base_moe_mlp_dim"), "heads": ("model.num_heads", "base_num_query_heads"),
    "head_dim": ("model.head_dim", "head_dim"), "vocab": ("model.vocab_size", "vocab_size"),
    "seq": ("model.seq_len", "max_target_length"), "batch": ("train.batch_size", "per_device_batch_size"),
    "kv_heads": ("model.num_kv_heads", "base_num_kv_heads"), "fsdp": ("mesh.fsdp", "ici_fsdp_parallelism"),
    "tensor": ("mesh.tensor", "ici_tensor_parallelism"), "dtype": ("train.precision", "dtype"),
    "remat": ("model.remat", "remat_policy"), "experts": ("model.num_experts", "num_experts"),
    "top_k": ("model.top_k", "num_experts_per_tok"),
    "load_balancing": ("model.load_balancing_coef", "load_balance_loss_weight"),
}


def _field(cfg, path: str):
    value = cfg
    for name in path.split("."):
        value = getattr(value, name)
    return value.value if isinstance(value, enum.Enum) else value


def test_moe_shape_maps_every_field_to_both_frameworks():
    """The MoE shape of ``bench_vs_maxtext.py --shape moe`` (and a variant whose every field differs from
    configs/moe_tiny.yaml's) becomes the same model, batch, mesh, precision and remat on both sides:
    every Shape field reaches meshtrain's config and MaxText's overrides, meshtrain's MoE is the sorted
    dropless dispatch with worst-case exchange buffers, MaxText's its dropless sparse path on ragged_dot.
    Compile-free: the config is only loaded."""
    from meshtrain.config import load_config
    from models.api import family_of

    assert set(SHAPE_FIELDS) == {field.name for field in dataclasses.fields(maxtext.Shape)}
    shape = maxtext.SHAPES["moe"]
    assert (shape.experts, shape.top_k, shape.fsdp, shape.tensor, shape.dtype, shape.remat) == (
        8, 2, 4, 2, "bfloat16", "full")
    variant = dataclasses.replace(shape, embed=192, layers=3, mlp=384, heads=8, kv_heads=4, head_dim=24,
                                  vocab=1000, seq=128, batch=24, fsdp=8, tensor=1, experts=6, top_k=3,
                                  load_balancing=0.02)
    config = maxtext.default_config(shape)
    assert config == "configs/moe_tiny.yaml"
    base = load_config(str(ROOT / config), [])
    precision = {"bfloat16": "bf16", "float32": "fp32"}
    for case in (shape, variant):
        cfg = load_config(str(ROOT / config), maxtext.maxtext_overrides(case))
        theirs = dict(arg.split("=", 1) for arg in maxtext.maxtext_args(case, 7, "/out"))
        for name, (ours, key) in SHAPE_FIELDS.items():
            value = getattr(case, name) if name != "kv_heads" else case.num_kv_heads
            mine = precision[value] if name == "dtype" else value
            assert _field(cfg, ours) == mine, (name, ours)
            if case is variant:  # a field left unmapped would keep the config's value and fail above
                assert _field(base, ours) != mine, (name, ours)
            if name == "batch":
                value //= case.devices  # MaxText takes sequences per device
            elif name == "remat":
                value = maxtext.REMAT[value]
            assert theirs[key] == str(value), (name, key)
        assert (family_of(cfg.model).name, cfg.mesh.data, cfg.mesh.stage) == ("moe", 1, 1)
        assert (_field(cfg, "model.dispatch"), cfg.model.exchange_buffer_factor, cfg.model.group_size,
                cfg.model.norm_topk_prob, cfg.model.shared_mlp_dim, cfg.model.bias_update_rate,
                cfg.model.z_loss_coef) == ("dropless", 0, 0, True, 0, 0, 0)
        assert {"decoder_block": "mixtral", "base_mlp_dim": str(case.mlp), "sparse_matmul": "true",
                "megablox": "false", "use_tokamax_gmm": "false", "capacity_factor": "-1",
                "ici_data_parallelism": "1"}.items() <= theirs.items()
    # A dense shape stays a Llama on both sides.
    dense = maxtext.SHAPES["issue"]
    assert maxtext.default_config(dense) == "configs/tiny.yaml"
    assert not {"decoder_block", "num_experts"} & set(dict(a.split("=", 1) for a in maxtext.maxtext_args(
        dense, 7, "/out")))


@pytest.mark.slow
def test_vs_maxtext_both_dtypes_with_the_baseline(tmp_path):
    """``bench_vs_maxtext.py --shape tiny --dtype bfloat16 float32 --vs-baseline``: meshtrain and the
    hand-written steps are really timed on the smoke-test shape in each dtype, MaxText is the stand-in
    (0.3 s per step in fp32, 0.1 s in bf16)."""
    venv = _fake_maxtext(tmp_path / "venv")
    out = tmp_path / "result.json"
    proc = _script("bench_vs_maxtext.py", "--shape", "tiny", "--steps", "2", "--rounds", "2", "--dtype", "bfloat16",
                   "float32", "--vs-baseline", "--json", str(out), env={"MAXTEXT_VENV": str(venv)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = (venv / "calls").read_text().splitlines()
    assert [next(a for a in call.split() if a.startswith("dtype=")) for call in calls] == (
        ["dtype=bfloat16"] * 2 + ["dtype=float32"] * 2)
    results = json.loads(out.read_text())["results"]
    for dtype, maxtext_step in (("bfloat16", 0.1), ("float32", 0.3)):
        part = results["by_dtype"][dtype]
        assert part["order"] == ["meshtrain", "maxtext", "maxtext", "meshtrain"]
        assert part["maxtext"]["step_time_s_median"] == maxtext_step and part["maxtext"]["spread"] == 0
        # MaxText's median is the stand-in's known step: the ratio is meshtrain's median over it.
        assert part["ratio"] == pytest.approx(part["meshtrain"]["step_time_s_median"] / maxtext_step)
        assert len(part["meshtrain"]["run_medians_s"]) == len(part["round_ratios"]) == 2
        assert len(part["baseline"]["run_medians_s"]) == len(part["baseline_guarded"]["run_medians_s"]) == 2
        assert all(part[key] > 0 for key in ("overhead_ratio", "guarded_overhead_ratio", "guard_ratio"))
        assert part["maxtext"]["loss_first"] == 10.0 and part["meshtrain"]["loss_first"] > 0
    speedups = results["bf16_over_fp32"]
    assert set(speedups) == {"meshtrain", "maxtext", "baseline"}
    assert speedups["maxtext"] == pytest.approx(3.0)  # 0.3 s / 0.1 s
    assert "bf16 over fp32 (fp32 median / bf16 median): meshtrain" in proc.stdout
