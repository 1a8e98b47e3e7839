"""The GPU compile tier (``make test-gpu-compile``, in ``.venv-gpu``): every test compiles train steps
with XLA:GPU for compile-only H100/H200/B200 devices on this CPU machine (``meshtrain.gpu_compile``),
as ``python -m meshtrain.compile`` does, and asserts from the optimized HLO.

This process is prepared as the compile tool prepares its own, before JAX's backends start: the
CUDA plugin's topologies (``jax_platforms=cpu``: a missing plugin fails every test in one line, no
test is skipped), the deviceless XLA flags and the recommended GPU flags of ``meshtrain.train``.
"""

from meshtrain.gpu_compile import start_compile_only
from meshtrain.xla_flags import apply_recommended

start_compile_only()
apply_recommended(force=True)
