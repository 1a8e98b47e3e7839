"""meshtrain.plan on a mixture of experts: the experts' state per device under expert parallelism
(1/EP of it, at every ZeRO stage, as the trainer lays it out), and the estimate against XLA's
compiled memory analysis of the real train step (docs/memory.md states the measured errors)."""

from __future__ import annotations

import math
import pathlib

import pytest

from meshtrain import plan as planner
from meshtrain.config import load_config
from meshtrain.parallel.rules import mesh_axes_of
from models.common import RematPolicy
from plan_checks import XLA_CPU, assert_state_matches, assert_temp_within
from utils import trainer_of_config

REPO = pathlib.Path(__file__).resolve().parents[1]
MOE_TINY = REPO / "configs" / "moe_tiny.yaml"
GB = 1e9
# The state (arguments, outputs) is counted exactly; 1% catches a replicated expert at once.
STATE_TOLERANCE = 0.01
# Experts held by every device: the layout expert parallelism saves memory against.
REPLICATED_EXPERTS = "sharding.rules.experts={params: null, activations: null}"
# fp32 bytes per parameter element of each part of the state: weights, gradients, Adam's moments.
STATE_PARTS = {"params": 4, "grads": 4, "optimizer": 8}


def _estimate(overrides, mesh, zero, remat="full"):
    cfg = load_config(MOE_TINY, overrides)
    (est,) = planner.make_plan(cfg, 8, 80 * GB, meshes=[mesh], zero_stages=[zero],
                               remats=[RematPolicy(remat)], hardware=XLA_CPU).estimates
    assert not est.reasons, est.reasons
    return cfg, est


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("mesh", [(2, 2, 2, 1), (1, 8, 1, 1), (8, 1, 1, 1), (1, 4, 2, 1)])
def test_planner_holds_one_ep_th_of_the_expert_state_per_device(mesh, zero):
    """Expert parallelism is not ZeRO: each of the EP = data x fsdp devices holds, and updates,
    num_experts / EP experts whatever the ZeRO stage (expert_mlp is split over tensor besides)."""
    cfg, ep_est = _estimate([], mesh, zero)
    _, replicated = _estimate([REPLICATED_EXPERTS], mesh, zero)
    model = cfg.model
    experts = model.num_layers * model.num_experts * model.expert_params / mesh[2]  # elements, per tensor rank
    ep = mesh[0] * mesh[1]
    for part, nbytes in STATE_PARTS.items():
        saved = getattr(replicated, part) - getattr(ep_est, part)
        assert saved == pytest.approx(nbytes * experts * (1 - 1 / ep), rel=1e-6), part


@pytest.mark.parametrize("zero", [0, 2])
def test_the_trainer_keeps_the_expert_split_at_every_zero_stage(zero):
    cfg = load_config(MOE_TINY, ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", f"zero.stage={zero}"])
    trainer = trainer_of_config(cfg)
    for part in STATE_PARTS:
        spec = getattr(trainer.part_shardings, part)["layers"]["moe"]["gate"].get_value().spec
        assert spec[1] == ("data", "fsdp"), (part, spec)
    # ZeRO < 3 still replicates the dense weights over fsdp.
    dense = trainer.part_shardings.params["layers"]["attention"]["query"].get_value().spec
    assert not any("fsdp" in mesh_axes_of(entry) for entry in dense), dense


# (overrides, mesh, ZeRO stage, remat): layouts and shapes of the tiny MoE (8 experts, top-2,
# capacity 1.25 in groups of 16; the sorted and one-hot dropless dispatches), some of them outside
# the shapes the formulas were fitted on.
CASES = {
    "ep4-hybrid-zero3-none": ([], (2, 2, 2, 1), 3, "none"),
    "ep8-fsdp-zero3-full-dropless": (["model.dispatch=dropless"], (1, 8, 1, 1), 3, "full"),
    "ep8-fsdp-zero3-none-dropless-buffers1.5": (["model.dispatch=dropless", "model.exchange_buffer_factor=1.5"],
                                                (1, 8, 1, 1), 3, "none"),
    "ep8-fsdp-zero3-full-onehot": (["model.dispatch=onehot"], (1, 8, 1, 1), 3, "full"),
    "ep8-data-dots": ([], (8, 1, 1, 1), 3, "dots"),
    "ep8-fsdp-zero0-full": ([], (1, 8, 1, 1), 0, "full"),
    "ep4-tp2-zero2-none-shared": (["model.shared_mlp_dim=128"], (1, 4, 2, 1), 2, "none"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_state_and_temp_bytes_against_the_compiler(name):
    """State bytes within STATE_TOLERANCE, temp bytes within the dense layouts' tolerance."""
    overrides, mesh, zero, remat = CASES[name]
    _, est = _estimate(overrides, mesh, zero, remat)
    xla = planner.verify(str(MOE_TINY), overrides, est, math.prod(mesh))
    assert_state_matches(est, xla, tolerance=STATE_TOLERANCE)
    assert_temp_within(name, est, xla)
