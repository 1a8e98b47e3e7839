"""The planner's estimate against XLA's compiled memory analysis, as the planner's test modules check it:
the estimate with XLA:CPU's constants (what the simulated devices compile with), the state's bytes and
the temporaries' within stated tolerances."""

from __future__ import annotations

import pytest

from meshtrain.planner.constants import Compiler
from meshtrain.planner.roofline import Hardware

# Argument and output bytes (the state and the batch) are counted exactly: within 10% required.
STATE_TOLERANCE = 0.10
# Temp bytes depend on XLA's buffer reuse; the model's working-set multipliers were fitted on
# mesh (1, 8, 1, 1). Measured errors on the layouts below: see docs/memory.md.
TEMP_TOLERANCE = 0.15
# Cases where XLA releases reuse buffers differently, each allowed to overestimate by more (a plan on
# the safe side): the bf16 accumulation case's temp bytes are 6,288,272 on jax 0.10.2, which the
# model was fitted on, and 4,533,392 on 0.11.2 (the model: 5,991,680; -4.7% and +32.2%).
OVERESTIMATE_TOLERANCE = {"small-bf16-accum2": 0.35}

# The simulated CPU devices' hardware: the estimate with XLA:CPU's constants, which these tests compile with.
XLA_CPU = Hardware(compiler=Compiler.XLA_CPU)


def assert_state_matches(est, xla, tolerance=STATE_TOLERANCE):
    """The estimate's argument and output bytes against ``verify``'s (XLA's)."""
    assert est.argument_bytes == pytest.approx(xla["argument"], rel=tolerance), (est, xla)
    assert est.output_bytes == pytest.approx(xla["output"], rel=tolerance), (est, xla)


def assert_temp_within(name, est, xla, tolerance=TEMP_TOLERANCE):
    """The estimate's temp bytes against XLA's (the error is printed, for docs/memory.md)."""
    error = (est.temp_bytes - xla["temp"]) / xla["temp"]
    print(name, est.temp_bytes, xla["temp"], f"{error:+.1%}")
    assert -tolerance <= error <= OVERESTIMATE_TOLERANCE.get(name, tolerance), (name, est.temp_bytes, xla["temp"])
