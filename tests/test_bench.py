"""The benchmark harness, the GPU check's CPU dry run and the recommended XLA flags keep working.

No timing assertions: only that the fields are printed and the numbers are sane.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench
from compile_flags import FAST_COMPILE_XLA_FLAG

from meshtrain import xla_flags

FIELDS = ("step_time_s_median", "tokens_per_sec", "tflops_per_device", "mfu", "compile_s",
          "memory_per_device", "collectives", "overhead_ratio", "guarded_overhead_ratio", "guard_ratio",
          "baseline", "baseline_guarded", "bytes_accessed", "guard_bytes")


@pytest.mark.slow
def test_bench_vs_baseline_prints_fields(capsys):
    assert bench.main(["--config", str(ROOT / "configs/tiny.yaml"), "--steps", "2", "--vs-baseline"]) == 0
    out = capsys.readouterr().out
    for field in FIELDS:
        assert f"\n{field}: " in out
    result = json.loads(out.strip().splitlines()[-1].removeprefix("json: "))
    assert result["devices"] == 8 and result["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}
    assert result["mfu"] is None  # CPU: no known peak
    assert result["step_time_s_median"] > 0 and result["overhead_ratio"] > 0
    assert result["memory_per_device"]["argument_bytes"] > 0
    # Same init, same batch, same loss: the baseline's first step computes the same loss.
    assert result["baseline"]["loss_first"] == pytest.approx(result["loss_first"], rel=1e-5)
    assert result["baseline_guarded"]["loss_first"] == pytest.approx(result["loss_first"], rel=1e-5)
    assert result["guard_ratio"] == pytest.approx(result["baseline_guarded"]["step_time_s_median"]
                                                  / result["baseline"]["step_time_s_median"])
    assert result["collectives"]["all-gather"] > 0  # FSDP gathers parameters
    # The guard's passes show in XLA's byte count, and meshtrain's step moves what the guarded
    # hand-written one moves (the scalar metrics aside): the trainer adds no pass of its own.
    plain, guarded = result["baseline"]["bytes_accessed"], result["baseline_guarded"]["bytes_accessed"]
    assert result["guard_bytes"] == guarded - plain > 0
    assert result["bytes_accessed"] == pytest.approx(guarded, rel=1e-3)
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

    sys.path.insert(0, str(ROOT / "tests"))
    from utils import make_trainer

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
    batch = bench.random_batch(trainer)
    before = [np.asarray(x) for x in jax.tree.leaves((params, opt_state))]
    copies = lambda tree: jax.tree.map(lambda x: x.copy(), tree)  # the steps donate their inputs
    kept = bench.baseline_step(trainer, guarded=True)(copies(params), copies(opt_state), batch)
    applied = bench.baseline_step(trainer)(copies(params), copies(opt_state), batch)
    assert np.isnan(float(kept[2])) and np.isnan(float(applied[2]))
    for old, new in zip(before, jax.tree.leaves(kept[:2])):
        np.testing.assert_array_equal(np.asarray(new), old)
    assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(applied[0]))


@pytest.mark.slow
def test_bench_sweep_experts_counts_all_to_all_and_active_flops(monkeypatch, tmp_path):
    """--sweep experts: experts replicated (EP 1) need no all-to-all, EP 4 does; FLOPs per token are
    the family's, of the active parameters (top_k experts)."""
    from meshtrain.config import load_config
    from models.api import family_of

    monkeypatch.setattr(bench, "EXPERT_LAYOUTS", bench.EXPERT_LAYOUTS[:2])
    config, out = str(ROOT / "configs/moe_tiny.yaml"), tmp_path / "experts.json"
    assert bench.main(["--sweep", "experts", "--config", config, "--steps", "1", "--json", str(out)]) == 0
    replicated, ep4 = json.loads(out.read_text())["results"]
    assert replicated["collectives"]["all-to-all"] == 0 < ep4["collectives"]["all-to-all"]
    assert ep4["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}
    model = load_config(config).model
    assert ep4["flops_per_token"] == pytest.approx(family_of(model).flops_per_token(model))
    assert ep4["flops_per_token"] < 6 * model.num_params  # not every expert counted


def test_bench_sweep_experts_refuses_a_dense_config():
    with pytest.raises(SystemExit, match="no expert axes"):
        bench.main(["--sweep", "experts", "--config", str(ROOT / "configs/tiny.yaml"), "--steps", "1"])


def test_collective_counts():
    text = "  %a = f32[4] all-gather(x)\n  %b = f32[4] all-reduce-start(y)\n  %c = f32[4] add(x, y)\n"
    assert bench.collective_counts(text) == {"all-gather": 1, "all-reduce": 1, "reduce-scatter": 0,
                                             "collective-permute": 0, "all-to-all": 0}


@pytest.mark.slow
def test_gpu_check_dry_run():
    # Only the suite's compile-speed flag (tests/conftest.py), no simulated devices: one CPU device.
    env = {**os.environ, "PYTHON": sys.executable, "XLA_FLAGS": FAST_COMPILE_XLA_FLAG}
    proc = subprocess.run([str(ROOT / "scripts/gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("json: "))
    assert report["dry_run"] and report["loss_check"]["passed"]
    assert report["throughput"]["tokens_per_sec"] > 0 and "mfu" in report["throughput"]
    planned = report["throughput"]["planner"]
    assert planned["xla_temp_bytes"] > 0 and not planned["reasons"]
    assert planned["estimate_temp_bytes"] == max(planned["estimate_update_bytes"], planned["estimate_backward_bytes"])
    assert "host_temp_bytes" in report["offload"]["memory_per_device"]
    assert report["checkpoint"]["passed"] and report["checkpoint"]["bit_equal"]
    assert report["ring_tiles"]["passed"] and report["ring_tiles"]["grads_rel_l2"][0] < 2e-5
    overhead = report["overhead"]
    assert overhead["guard_ratio"] == pytest.approx(overhead["baseline_guarded_s"] / overhead["baseline_s"])
    guarded, plain = overhead["baseline_guarded_bytes_accessed"], overhead["baseline_bytes_accessed"]
    assert overhead["guard_bytes"] == guarded - plain > 0
    assert "TFLOP/s" in proc.stdout and "MFU" in proc.stdout


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
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "3.0", proc.stderr[-2000:]


def test_model_attention_picks_the_dot_product_attention_implementation():
    """model.attention reaches jax.nn.dot_product_attention: 'cudnn' is rejected on CPU, 'xla' runs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.blocks import AttentionKernel
    from models.llama import Llama, LlamaConfig

    tokens = jnp.zeros((1, 8), jnp.int32)
    logits = dict.fromkeys(AttentionKernel)
    for kernel in (AttentionKernel.AUTO, AttentionKernel.XLA):
        logits[kernel] = Llama(LlamaConfig(attention=kernel), rngs=nnx.Rngs(0))(tokens)
    assert jnp.array_equal(logits[AttentionKernel.AUTO], logits[AttentionKernel.XLA])
    with pytest.raises(RuntimeError, match="cuDNN"):  # no cuDNN on CPU
        jax.block_until_ready(Llama(LlamaConfig(attention=AttentionKernel.CUDNN), rngs=nnx.Rngs(0))(tokens))


def test_xla_flags_applied_for_gpu_runs(monkeypatch):
    monkeypatch.setattr(xla_flags, "gpu_run_expected", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    added = xla_flags.apply_recommended()
    assert len(added) == len(xla_flags.RECOMMENDED_GPU_FLAGS) - 1  # the user's value is kept
    assert os.environ["XLA_FLAGS"].startswith("--xla_gpu_enable_latency_hiding_scheduler=false ")
    monkeypatch.setenv(xla_flags.DISABLE_ENV, "0")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert xla_flags.apply_recommended() == [] and os.environ["XLA_FLAGS"] == ""


def test_vs_maxtext_not_installed(monkeypatch, capsys, tmp_path):
    """Without MaxText's venv the comparison says so in one line and exits 0: no test needs MaxText."""
    import bench_maxtext

    monkeypatch.setattr(bench_maxtext, "VENV", str(tmp_path / "absent"))
    monkeypatch.delenv("MAXTEXT_VENV", raising=False)
    assert bench_maxtext.run_maxtext(bench_maxtext.SHAPES["issue"]) is None
    assert bench_maxtext.main(["--shape", "large"]) == 0
    assert bench.main(["--vs-maxtext"]) == 0
    assert capsys.readouterr().out == f"{bench_maxtext.NOT_INSTALLED}\n" * 3


def test_maxtext_log_and_args():
    import bench_maxtext

    log = ("I1201 metric_logger.py:265] completed step: 3, seconds: 1.234, TFLOP/s/device: 0.021, "
           "Tokens/s/device: 271.877, total_weights: 2048, loss: 10.876, lm_loss: 10.876, perplexity: 52867.070\n")
    assert bench_maxtext.parse_steps(log) == [(3, 1.234, 10.876)]
    args = bench_maxtext.maxtext_args(bench_maxtext.SHAPES["issue"], 23, "/tmp/out")
    assert {"base_emb_dim=256", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "per_device_batch_size=1",
            "remat_policy=full", "steps=23", "attention=dot_product"} <= set(args)


@pytest.mark.slow
def test_vs_maxtext_both_dtypes_with_the_baseline(monkeypatch, capsys, tmp_path):
    """``--vs-maxtext --dtype bfloat16 float32 --vs-baseline``: meshtrain and the hand-written step are
    really timed on a small shape in each dtype, MaxText's runner is replaced by a stand-in that
    takes 0.3 s per step in fp32 and 0.1 s in bf16; the ratios and speedups are computed from those."""
    import bench_maxtext

    shape = bench_maxtext.Shape(embed=32, layers=1, mlp=64, heads=2, head_dim=16, vocab=256, seq=32)
    calls = []

    def fake_maxtext(run_shape, steps):
        calls.append(run_shape.dtype)
        per_step = {"float32": 0.3, "bfloat16": 0.1}[run_shape.dtype]
        return {"step_time_s_median": per_step, "step_time_s_min": per_step, "step_times_s": [per_step] * steps,
                "warmup_steps": 3, "jax": "stand-in", "loss_first": 5.5}

    monkeypatch.setitem(bench_maxtext.SHAPES, "unit", shape)
    monkeypatch.setattr(bench_maxtext, "installation", lambda: "stand-in")
    monkeypatch.setattr(bench_maxtext, "run_maxtext", fake_maxtext)
    out_path = tmp_path / "result.json"
    assert bench.main(["--vs-maxtext", "--shape", "unit", "--steps", "2", "--rounds", "2", "--dtype", "bfloat16",
                       "float32", "--vs-baseline", "--json", str(out_path)]) == 0
    assert calls == ["bfloat16"] * 2 + ["float32"] * 2
    results = json.loads(out_path.read_text())["results"]
    for dtype, maxtext_step in (("bfloat16", 0.1), ("float32", 0.3)):
        part = results["by_dtype"][dtype]
        assert part["order"] == ["meshtrain", "maxtext", "maxtext", "meshtrain"]
        assert part["maxtext"]["step_time_s_median"] == maxtext_step
        assert part["ratio"] == pytest.approx(part["meshtrain"]["step_time_s_median"] / maxtext_step)
        assert len(part["baseline"]["run_medians_s"]) == len(part["baseline_guarded"]["run_medians_s"]) == 2
        assert part["overhead_ratio"] == pytest.approx(
            part["meshtrain"]["step_time_s_median"] / part["baseline"]["step_time_s_median"])
        assert part["guarded_overhead_ratio"] == pytest.approx(
            part["meshtrain"]["step_time_s_median"] / part["baseline_guarded"]["step_time_s_median"])
    speedups = results["bf16_over_fp32"]
    assert speedups["maxtext"] == pytest.approx(3.0)
    fp32, bf16 = results["by_dtype"]["float32"], results["by_dtype"]["bfloat16"]
    assert speedups["meshtrain"] == pytest.approx(fp32["meshtrain"]["step_time_s_median"]
                                                  / bf16["meshtrain"]["step_time_s_median"])
    assert "bf16 over fp32 (fp32 median / bf16 median): meshtrain" in capsys.readouterr().out
