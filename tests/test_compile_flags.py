"""tests/compile_flags.py: the suite's XLA flags are tried against the installed jaxlib first, since an
unknown XLA_FLAGS entry aborts the process when JAX's backend starts (jaxlib 0.11 removed
``--xla_cpu_use_fusion_emitters``, which aborted every test process of the suite on jax 0.11)."""

from compile_flags import FAST_COMPILE_XLA_FLAGS, KNOWN_FAST_COMPILE_XLA_FLAGS, known_xla_flags


def test_unknown_xla_flags_are_left_out():
    flags = ["--xla_backend_optimization_level=0", "--xla_meshtrain_no_such_flag=1", "--xla_meshtrain_nor_this=2"]
    assert known_xla_flags(flags) == ["--xla_backend_optimization_level=0"]


def test_fast_compile_flags_known_here():
    # LLVM's optimization level is a flag of every supported jaxlib; the rest as this one has them.
    assert KNOWN_FAST_COMPILE_XLA_FLAGS[0] == "--xla_backend_optimization_level=0"
    assert set(KNOWN_FAST_COMPILE_XLA_FLAGS) <= set(FAST_COMPILE_XLA_FLAGS)
