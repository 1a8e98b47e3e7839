"""The XLA flag the test processes compile with (tests/conftest.py says why): LLVM optimization level
0. Subprocesses that start without the session's XLA_FLAGS pass this one on."""

FAST_COMPILE_XLA_FLAG = "--xla_backend_optimization_level=0"
