"""Measuring a step, for the scripts, the tests and the compile tools (the trainer imports none of it):

- ``benchmark.py`` times a compiled step (and a plain-``jax.jit`` baseline of the same model);
- ``flops.py``     counts the matmul FLOPs of a traced step, scan trip counts included;
- ``hlo.py``       reads a compiled program: collectives, bytes, memory, kernels launched;
- ``maxtext.py``   the shapes compared with MaxText, as each framework's overrides.
"""
