"""meshtrain/xla_flags.py (issue 37 item 5): combine thresholds derived from one layer's bytes,
collective matmul only with tensor parallelism, and every flag and arm parsed by the installed jaxlib
with the values it sets read back from XLA's own dump (an unknown flag aborts XLA at start-up; CI runs
this on the oldest and the newest supported jaxlib). tests/test_bench.py checks the set without a
layout and that a user's XLA_FLAGS win."""

import importlib.metadata
import json
import math
import os
import pathlib
import re
import subprocess
import sys

from meshtrain import cli, xla_flags
from meshtrain.config import load_config
from meshtrain.errors import ConfigError

MIB = 1 << 20
# configs/llama_8b.yaml: embed 4096, 32 heads and 8 KV heads of 128, MLP 14336.
E, HEADS, KV, D, M = 4096, 32, 8, 128, 14336
TP_SPLIT = 2 * E * HEADS * D + 2 * E * KV * D + 3 * E * M  # q, o, k, v, gate/up/down: split by tensor
NORMS = 2 * E  # the two norm scales: not split by tensor


def _layout(config: str, data: int = 1, fsdp: int = 1, tensor: int = 1, stage: int = 1, *overrides: str):
    mesh = {"data": data, "fsdp": fsdp, "tensor": tensor, "stage": stage}
    cfg = load_config(config, [f"mesh.{axis}={size}" for axis, size in mesh.items()] + list(overrides))
    return cfg.layout(mesh)


def _ceil_mib(nbytes: float) -> int:
    return max(32 * MIB, math.ceil(nbytes / MIB) * MIB)


def test_thresholds_of_an_8b_layer():
    """FSDP 8: the all-gather threshold holds one whole layer in fp32 (4 B x 218.1M = 872 MB, above the
    fixed 128 MiB), the reduce-scatter one its gradient shard (1/8 of it); nothing is all-reduced (no
    data parallelism beside fsdp): the floor."""
    layer = TP_SPLIT + NORMS
    assert layer == 218_112_000  # ~436 MB in bf16, as issue 37 says
    fsdp = xla_flags.combine_thresholds(_layout("configs/llama_8b.yaml", fsdp=8))
    assert fsdp == xla_flags.CombineThresholds(_ceil_mib(4 * layer), _ceil_mib(4 * layer / 8), 32 * MIB)
    assert fsdp.all_gather == 833 * MIB > xla_flags.FIXED_COMBINE_BYTES
    # Tensor 2 halves what each device gathers of the split weights (not of the norms); fsdp 4 shards
    # it, and data 2 all-reduces those shards.
    mixed = xla_flags.combine_thresholds(_layout("configs/llama_8b.yaml", data=2, fsdp=4, tensor=2))
    gathered = TP_SPLIT / 2 + NORMS
    assert mixed == xla_flags.CombineThresholds(_ceil_mib(4 * gathered), _ceil_mib(gathered), _ceil_mib(gathered))
    # Pipeline stages split the stack of layers, not a layer: the same per-layer bytes.
    staged = xla_flags.combine_thresholds(_layout("configs/llama_8b.yaml", data=1, fsdp=4, tensor=2, stage=2))
    assert (staged.all_gather, staged.reduce_scatter) == (mixed.all_gather, mixed.reduce_scatter)
    # Pure data parallelism gathers nothing: the floor; it all-reduces the whole layer's gradients.
    dp = xla_flags.combine_thresholds(_layout("configs/llama_8b.yaml", data=8))
    assert dp == xla_flags.CombineThresholds(32 * MIB, 32 * MIB, _ceil_mib(4 * layer))
    # ZeRO-1 keeps parameters and gradients whole: nothing gathered or reduce-scattered.
    zero1 = xla_flags.combine_thresholds(_layout("configs/llama_8b.yaml", 1, 8, 1, 1, "zero.stage=1"))
    assert zero1 == xla_flags.CombineThresholds(32 * MIB, 32 * MIB, _ceil_mib(4 * layer))
    assert xla_flags.combine_thresholds(None) == xla_flags.CombineThresholds(*[128 * MIB] * 3)


def test_thresholds_take_the_largest_stack():
    """DeepSeek-V3's three dense layers are a stack of their own (``dense_layers``) beside the MoE
    ``layers``. Under fsdp 8 the routed experts stay split (expert parallelism: never gathered), so
    the largest gathered layer is a dense one, its MLP alone 3 x 7168 x 18432 weights."""
    layout = _layout("configs/deepseek_v3_671b.yaml", fsdp=8)
    layer = xla_flags.layer_bytes(layout)
    dense_mlp = 3 * 7168 * 18432
    assert 4 * dense_mlp < layer.gathered < 4 * 1.6 * dense_mlp  # plus its latent attention (~187M)
    assert xla_flags.combine_thresholds(layout).all_gather == _ceil_mib(layer.gathered)
    assert 0 < layer.reduced < MIB  # experts split over the batch axes, the rest reduce-scattered but small
    # weights fsdp leaves whole (the routing bias, the norms: all-reduced)


def test_collective_matmul_only_with_tensor_parallelism():
    names = lambda layout: {name for name, _, _ in xla_flags.recommended_set(layout)}
    windowed = {xla_flags.WINDOWED_EINSUM, xla_flags.MULTI_STREAMED_EINSUM}
    assert not windowed & names(_layout("configs/llama_8b.yaml", fsdp=8))
    assert not windowed & names(None)
    # Beside FSDP or DP, XLA:GPU refuses to compile collective matmul (tests_gpu compiles both).
    assert not windowed & names(_layout("configs/llama_8b.yaml", fsdp=4, tensor=2))
    assert not windowed & names(_layout("configs/llama_8b.yaml", data=2, tensor=4))
    tp = _layout("configs/llama_8b.yaml", tensor=8)
    assert windowed <= names(tp)
    assert xla_flags.arm_setting(xla_flags.Arm.DERIVED, tp).options[xla_flags.WINDOWED_EINSUM] == "0"
    assert xla_flags.arm_setting(xla_flags.Arm.FIXED, tp).options[xla_flags.WINDOWED_EINSUM] == "100000"


def test_arms():
    """Each arm sets every flag that differs between arms; FIXED is the set before issue 37, O1 is
    DERIVED at jax_optimization_level O1."""
    layout = _layout("configs/llama_8b.yaml", fsdp=8)
    fixed, derived, o1 = (xla_flags.arm_setting(arm, layout) for arm in xla_flags.Arm)
    assert set(fixed.options) == set(derived.options) == set(xla_flags.ARM_FLAGS)
    assert fixed.options[xla_flags.ALL_GATHER] == str(128 * MIB) and fixed.optimization_level is None
    assert fixed.options[xla_flags.COMMAND_BUFFER] == xla_flags.xla_default_command_buffers()
    assert derived.options[xla_flags.ALL_GATHER] == str(xla_flags.combine_thresholds(layout).all_gather)
    assert derived.options[xla_flags.COMMAND_BUFFER] == "" and derived.optimization_level is None
    assert o1.options == derived.options and o1.optimization_level == "O1"


# Compiles, in order, one small program per (module name, options, level): the same name, the same
# program. XLA_FLAGS dump what XLA compiled each with.
CHILD = """
import json, sys
import jax, jax.numpy as jnp
from meshtrain import xla_flags
x = jnp.ones((8, 8))
programs = {}
for name, options, level in json.loads(sys.argv[1]):
    if name not in programs:
        fn = lambda x, n=len(name): (x @ x).sum() + n
        fn.__name__ = name  # names the module XLA dumps: jit_<name>
        programs[name] = jax.jit(fn)
    setting = xla_flags.ArmSetting(options, level)
    assert float(xla_flags.compile_arm(lambda: programs[name].lower(x), setting)(x)) == 512 + len(name)
print("ok")
"""


def _dump(tmp_path: pathlib.Path, flags: list[str], compiles: list[tuple]) -> dict[str, list[tuple[str, str]]]:
    """Per module name, per compile of it: (its compile_options.textproto: the options from XLA_FLAGS
    in full, and the compile options as given; its .debug_options: what differs from XLA's defaults
    after both)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("JAX_COMPILATION_CACHE")}
    env.update(XLA_FLAGS=" ".join([*flags, f"--xla_dump_to={tmp_path}"]), JAX_PLATFORMS="cpu",
               JAX_ENABLE_COMPILATION_CACHE="false")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(compiles)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    modules = {}
    for folder in sorted(tmp_path.glob("module_*.jit_arm_*")):
        if folder.is_dir():
            modules.setdefault(folder.name.split(".jit_")[1], []).append(
                ((folder / "compile_options.textproto").read_text(),
                 (tmp_path / f"{folder.name}.debug_options").read_text()))
    return modules


def _values(text: str, name: str) -> list[str]:
    return re.findall(rf"^\s*{name}: (\S+)\s*$", text, re.MULTILINE)


def test_every_flag_parses_and_takes_effect(tmp_path):
    """The whole set of a tensor-parallel layout in XLA_FLAGS, each arm's options at compile: this
    jaxlib starts (an unknown flag aborts it), compiles each arm, and its dump shows the values: each
    flag of the set as given, an empty command-buffer set, and per arm its thresholds, windowed-einsum
    threshold and (O1 only) the optimization level. O1 compiles the program DERIVED compiled just
    before it: a second module is dumped, at EFFORT_O1 (through ``jax.config`` it was not: JAX's
    in-memory compile cache returned DERIVED's executable)."""
    layout = _layout("configs/llama_8b.yaml", tensor=8)
    settings = {arm: xla_flags.arm_setting(arm, layout) for arm in xla_flags.Arm}
    program = {xla_flags.Arm.FIXED: "arm_fixed", xla_flags.Arm.DERIVED: "arm_derived", xla_flags.Arm.O1: "arm_derived"}
    modules = _dump(tmp_path, xla_flags.recommended_flags(layout),
                    [(program[arm], setting.options, setting.optimization_level) for arm, setting in settings.items()])
    assert {name: len(dumps) for name, dumps in modules.items()} == {"arm_fixed": 1, "arm_derived": 2}
    flags_text = modules["arm_fixed"][0][0]
    assert _values(flags_text, xla_flags.COMMAND_BUFFER) == []  # "--xla_gpu_enable_command_buffer=": none
    for name, value, _ in xla_flags.recommended_set(layout):
        if name != xla_flags.COMMAND_BUFFER:
            (seen,) = _values(flags_text, name)
            assert seen == value or (value == "on" and seen.endswith("_ON")), (name, value, seen)
    dumps = {xla_flags.Arm.FIXED: modules["arm_fixed"][0], xla_flags.Arm.DERIVED: modules["arm_derived"][0],
             xla_flags.Arm.O1: modules["arm_derived"][1]}
    if "EFFORT_O1" in dumps[xla_flags.Arm.DERIVED][0]:  # module numbers order the dumps: by compile
        dumps[xla_flags.Arm.DERIVED], dumps[xla_flags.Arm.O1] = dumps[xla_flags.Arm.O1], dumps[xla_flags.Arm.DERIVED]
    for arm, (options_text, effective) in dumps.items():
        options = settings[arm].options
        for name in (xla_flags.ALL_GATHER, xla_flags.REDUCE_SCATTER, xla_flags.ALL_REDUCE, xla_flags.WINDOWED_EINSUM):
            # .debug_options lists what differs from XLA's defaults (the default windowed threshold: nothing)
            assert _values(effective, name) in ([options[name]], []), (arm, name)
            assert _values(effective, name) or options[name] == "100000", (arm, name)
        assert ("optimization_level: EFFORT_O1" in options_text) is (arm is xla_flags.Arm.O1)


def test_xla_default_command_buffers_are_this_jaxlibs(tmp_path):
    """The FIXED arm restores XLA's default command-buffer set: it is the installed jaxlib's default
    (read from the full options XLA dumps when XLA_FLAGS set nothing else)."""
    modules = _dump(tmp_path, [], [("arm_none", {}, None)])
    ((options_text, _),) = modules["arm_none"]
    assert sorted(_values(options_text, xla_flags.COMMAND_BUFFER)) == sorted(
        xla_flags.xla_default_command_buffers().split(","))
    assert _values(options_text, xla_flags.WINDOWED_EINSUM) == [str(xla_flags.XLA_DEFAULT_WINDOWED_EINSUM_MIB)]


def test_the_step_compiles_with_its_layouts_flags(monkeypatch):
    """XLA_FLAGS are read before a run has its layout, so the layout's flags reach the train step's
    compile as ``compiler_options``: 8B at (1,4,2,1) gets its derived thresholds, at (1,1,8,1)
    collective matmul too (booleans as XLA's options parse them); a threshold the user set in XLA_FLAGS is kept (not
    passed); the layout-free default ``apply_recommended`` puts there is refined; nothing under
    MESHTRAIN_XLA_FLAGS=0."""
    layout = _layout("configs/llama_8b.yaml", 1, 4, 2)
    thresholds = xla_flags.combine_thresholds(layout)
    monkeypatch.setenv("XLA_FLAGS", f"--{xla_flags.ALL_REDUCE}={xla_flags.FIXED_COMBINE_BYTES} "
                                    f"--{xla_flags.REDUCE_SCATTER}=12345")
    monkeypatch.delenv(xla_flags.DISABLE_ENV, raising=False)
    assert xla_flags.step_compiler_options(layout) == {
        xla_flags.ALL_GATHER: str(thresholds.all_gather), xla_flags.ALL_REDUCE: str(thresholds.all_reduce)}
    pure_tp = xla_flags.step_compiler_options(_layout("configs/llama_8b.yaml", 1, 1, 8))
    assert (pure_tp[xla_flags.WINDOWED_EINSUM], pure_tp[xla_flags.MULTI_STREAMED_EINSUM]) == ("0", True)
    assert thresholds.all_gather > xla_flags.FIXED_COMBINE_BYTES
    assert xla_flags.WINDOWED_EINSUM not in xla_flags.step_compiler_options(_layout("configs/llama_8b.yaml", 1, 8))
    monkeypatch.setenv(xla_flags.DISABLE_ENV, "0")
    assert xla_flags.step_compiler_options(layout) == {}


# ----- issue 53 item 14: XLA_FLAGS that would abort XLA are one line, before a backend starts -----

def _check_error(value: str) -> str:
    try:
        cli.check_xla_flags(value)
    except ConfigError as error:
        return str(error)
    return ""


def test_xla_flags_are_checked_against_this_jaxlib(tmp_path):
    """Flags XLA knows pass (quoted values, bare booleans, a file of flags); an unknown name, a token
    that is no flag, or a value that is neither flags nor a file is a ConfigError naming XLA_FLAGS."""
    recommended = " ".join(xla_flags.recommended_flags())
    flag_file = tmp_path / "flags"
    flag_file.write_text("--xla_dump_to=/tmp/dump\n--xla_backend_optimization_level=0\n")
    for good in ("", "  ", recommended, '--xla_dump_to="/tmp/a dir" --xla_cpu_use_fusion_emitters',
                 str(flag_file)):
        assert _check_error(good) == "", good
    assert _check_error("--xla_cpu_use_fusion_emitter=false") == (
        "XLA_FLAGS: '--xla_cpu_use_fusion_emitter=false': xla_cpu_use_fusion_emitter is no flag of this jaxlib "
        f"({importlib.metadata.version('jaxlib')}), and XLA would abort at start-up; did you mean "
        "--xla_cpu_use_fusion_emitters?")
    assert _check_error("--xla_dump_to=/tmp/x junk") == ("XLA_FLAGS: 'junk' is not a flag; give --name or "
                                                         "--name=value, separated by spaces")
    assert _check_error("-xla_dump_to=/tmp/x").startswith("XLA_FLAGS: '-xla_dump_to=/tmp/x' is not a flag")
    assert _check_error("garbage").startswith("XLA_FLAGS: 'garbage' is no flag (--name or --name=value, separated "
                                              "by spaces), and XLA reads a value not starting with '--' as a file")
    flag_file.write_text("--xla_nope=1\n")
    assert _check_error(str(flag_file)).startswith(f"XLA_FLAGS: '--xla_nope=1' (in the file {flag_file}): "
                                                   "xla_nope is no flag of this jaxlib")


def test_bad_xla_flags_are_one_line_and_exit_2_not_an_abort():
    """``meshtrain.train`` and ``meshtrain.plan`` with XLA_FLAGS that XLA's parser would abort the
    process on (a C++ fatal, no Python error): one ``error: XLA_FLAGS:`` line, exit 2."""
    cases = [(["meshtrain.train", "--config", "configs/tiny.yaml", "--host-devices", "1"], "--xla_no_such_flag=1",
              "error: XLA_FLAGS: '--xla_no_such_flag=1': xla_no_such_flag is no flag of this jaxlib"),
             (["meshtrain.plan", "--config", "configs/tiny.yaml", "--devices", "8", "--device-memory", "1GB",
               "--verify", "1"], "garbage", "error: XLA_FLAGS: 'garbage' is no flag")]
    for argv, value, expected in cases:
        env = {**os.environ, "XLA_FLAGS": value, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, "-m", *argv], cwd=pathlib.Path(__file__).resolve().parents[1],
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 2, (argv, proc.returncode, proc.stderr[-2000:])
        assert proc.stderr.strip().startswith(expected) and "\n" not in proc.stderr.strip(), proc.stderr
