"""The XLA flags the test processes compile with (tests/conftest.py says why). Subprocesses that start
without the session's XLA_FLAGS pass them on."""

FAST_COMPILE_XLA_FLAGS = (
    # LLVM at optimization level 0.
    "--xla_backend_optimization_level=0",
    # XLA:CPU's elemental IR emitter for fusions instead of the MLIR fusion emitters, which take
    # most of a small program's compile time: tests/test_plan.py and tests/test_long_context.py
    # (48 tests, fresh compilation cache) 125 s -> 76 s on 2 cores, jax 0.10.2; the same
    # collectives, memory_analysis() within 0.02%, every assertion passing.
    "--xla_cpu_use_fusion_emitters=false",
)
FAST_COMPILE_XLA_FLAG = " ".join(FAST_COMPILE_XLA_FLAGS)


def with_fast_compile(xla_flags: str) -> str:
    """``xla_flags`` plus each fast-compile flag it does not already set."""
    missing = [flag for flag in FAST_COMPILE_XLA_FLAGS if flag.split("=")[0] not in xla_flags]
    return " ".join([xla_flags, *missing]).strip()
