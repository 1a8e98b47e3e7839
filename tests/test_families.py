"""Model families as plugins: the framework names none, and a family defined under ``tests/``
(``tests/toy_family.py``: learned positions, LayerNorm, GELU MLP, an auxiliary loss) trains through
the real CLI on (2,2,2,1) and on a 1F1B pipeline equal to one device, resumes, and is planned.

Tolerances (fp32): losses relative 1e-5 per step, gradients relative L2 1e-5 per parameter.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest

from meshtrain import plan as planner
from meshtrain.config import load_config, to_dict
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.loop import train
from meshtrain.train import main
from models.api import FRAMEWORK_AXES, families
from models.common import RematPolicy
from toy_family import FAMILY as TOY_FAMILY
from toy_family import ToyGPTConfig
from utils import loss_and_grads, make_trainer, trainer_of_config

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
# The interface, the shared blocks and the kernels floor (models/kernels/), never a family.
ALLOWED_MODEL_IMPORTS = {"models", "models.api", "models.common", "models.kernels.attention", "models.kernels.fp8",
                         "models.kernels.grouped_matmul", "models.kernels.lora", "models.kernels.tokamax_attention"}
TOY = str(REPO / "tests" / "toy_gpt.yaml")  # the toy family, 4 layers, on the (2, 2, 2, 1) mesh
TOY_MODEL = ToyGPTConfig(num_layers=4)
PLUGIN = ["model.plugin=toy_family", "model.family=toy_gpt"]


def test_the_framework_imports_no_model_family():
    """Every ``models.*`` import under meshtrain/ is the interface (api), the shared blocks (common)
    or the kernels floor (models/kernels/)."""
    found = []
    for path in sorted((REPO / "meshtrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "models":
                names = [node.module] if node.module != "models" else [f"models.{a.name}" for a in node.names]
            found += [f"{path.relative_to(REPO)}: {name}" for name in names
                      if name.split(".")[0] == "models" and name not in ALLOWED_MODEL_IMPORTS]
    assert found == []


def test_unknown_family_and_plugin_are_one_line_errors(capsys):
    assert main(["--config", TINY, "model.family=gpt9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: model.family: unknown model family 'gpt9'; known: [")
    assert "'llama'" in err
    assert main(["--config", TINY, "model.plugin=no_such.module"]) == 2
    assert capsys.readouterr().err.startswith("error: model.plugin: cannot import 'no_such.module'")


def test_the_model_section_is_typed_by_its_family():
    cfg = load_config(TOY, ["model.aux_loss_weight=0.5"])
    assert isinstance(cfg.model, ToyGPTConfig) and cfg.model.aux_loss_weight == 0.5
    saved = to_dict(cfg)["model"]
    assert (saved["family"], saved["plugin"]) == ("toy_gpt", str(REPO / "tests" / "toy_family.py"))  # its file
    assert "toy_gpt" in families()
    with pytest.raises(Exception, match=r"model.num_kv_heads: is not a field of model.family 'toy_gpt'"):
        load_config(TOY, ["model.num_kv_heads=2"])  # a Llama field, not the toy's
    assert to_dict(load_config(TINY))["model"]["family"] == "llama"  # the default


def test_family_axes_get_the_rules_of_their_role():
    rules = Preset.FSDP_TP.rules.completed(TOY_FAMILY.axis_roles)
    assert set(rules.table) == set(FRAMEWORK_AXES) | {"positions", "qkv", "heads", "head_dim", "mlp"}
    assert rules.param_spec(("layers", "embed", "qkv", "heads", "head_dim")) == \
        jax.sharding.PartitionSpec(None, "fsdp", None, "tensor", None)
    assert rules.param_spec(("positions", "embed")) == jax.sharding.PartitionSpec(None, "fsdp")


def _trainer(mesh_shape, pipeline=PipelineConfig(), model=TOY_MODEL):
    return make_trainer(mesh_shape, model, pipeline=pipeline)


@pytest.fixture(scope="module")
def sequential():
    return loss_and_grads(_trainer((1, 1, 1, 1)))


def test_the_auxiliary_loss_is_part_of_the_objective(sequential):
    without, _ = loss_and_grads(_trainer((1, 1, 1, 1), model=dataclasses.replace(TOY_MODEL, aux_loss_weight=0.0)))
    assert abs(sequential[0] - without) / without > 1e-3


@pytest.mark.parametrize("mesh_shape, pipeline", [
    # The fast tier runs interleaved (two chunks per stage); the full suite every schedule.
    pytest.param((1, 2, 1, 2), PipelineConfig(4, Schedule.GPIPE), marks=pytest.mark.slow),
    pytest.param((1, 1, 2, 2), PipelineConfig(4, Schedule.ONE_F_ONE_B), marks=pytest.mark.slow),
    ((2, 1, 1, 2), PipelineConfig(2, Schedule.INTERLEAVED, virtual_stages=2)),
], ids=["gpipe", "1f1b", "interleaved"])
def test_aux_losses_reach_every_pipeline_schedule(sequential, mesh_shape, pipeline):
    loss, grads = loss_and_grads(_trainer(mesh_shape, pipeline))
    ref_loss, ref_grads = sequential
    assert abs(loss - ref_loss) / ref_loss <= 1e-5
    for name, expected in ref_grads.items():
        assert np.linalg.norm(grads[name] - expected) / np.linalg.norm(expected) <= 1e-5, name


def _losses(run_dir: pathlib.Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow
def test_toy_family_trains_through_the_cli_equal_to_one_device_and_resumes(tmp_path):
    single = tmp_path / "single"
    train(load_config(TOY, [f"run.dir={single}", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]),
          devices=jax.devices()[:1])
    reference = _losses(single)
    assert len(reference) == 4

    hybrid = tmp_path / "hybrid"  # (2,2,2,1): two steps, then resumed from its checkpoint to four
    assert main(["--config", TOY, "train.steps=2", "checkpoint.every=2", f"run.dir={hybrid}"]) == 0
    assert main(["--config", str(hybrid / "config.yaml"), "train.steps=4", f"run.dir={hybrid}"]) == 0
    pipelined = tmp_path / "pipelined"
    assert main(["--config", TOY, "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=1", "mesh.stage=4",
                 "pipeline.schedule=1f1b", "pipeline.microbatches=4", f"run.dir={pipelined}"]) == 0
    for run in (hybrid, pipelined):
        np.testing.assert_allclose(_losses(run), reference, rtol=1e-5, atol=0)


def test_the_planner_plans_the_toy_family_and_its_estimate_matches_the_compiler():
    cfg = load_config(TOY)
    plan = planner.make_plan(cfg, 8, 80e9, meshes=[(2, 2, 2, 1), (1, 2, 1, 4)], zero_stages=[3],
                             remats=[RematPolicy.FULL])
    fit, _, broken = plan.ranked()
    assert not broken and {e.candidate.label() for e in fit} == {"(2,2,2,1)", "(1,2,1,4)"}
    est = next(e for e in fit if e.candidate.label() == "(2,2,2,1)")
    xla = planner.verify(TOY, [], est, 8)
    assert est.argument_bytes == pytest.approx(xla["argument"], rel=0.10)


def _trainer_verdict(config: str, overrides: list[str], est) -> str | None:
    """The ConfigError the trainer raises for ``est``'s layout (None when it builds)."""
    from meshtrain.errors import ConfigError

    cfg = load_config(config, overrides + est.candidate.overrides())
    try:
        trainer_of_config(cfg, jax.devices()[:est.candidate.devices])
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("config", ["tiny.yaml", pytest.param("llama_10b.yaml", marks=pytest.mark.slow)])
def test_planner_and_trainer_agree_on_feasibility_of_every_layout(config):
    path = str(REPO / "configs" / config)
    plan = planner.make_plan(load_config(path), 8, 1e15)
    assert len(plan.estimates) > 100
    # The remat policy changes no layout's feasibility: one trainer per layout of the other fields.
    layouts = {dataclasses.replace(est.candidate, remat=RematPolicy.FULL): est for est in plan.estimates}
    assert all(bool(e.reasons) == bool(layouts[dataclasses.replace(e.candidate, remat=RematPolicy.FULL)].reasons)
               for e in plan.estimates)
    disagree = []
    for est in layouts.values():
        verdict = _trainer_verdict(path, [], est)
        if (verdict is None) != (not est.reasons):
            disagree.append((est.candidate.label(), est.reasons, verdict))
    assert disagree == []


def _imports(path: pathlib.Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return modules


def test_no_command_line_module_imports_another_and_config_does_not_import_the_trainer():
    package = REPO / "meshtrain"
    cli_modules = {f"meshtrain.{p.stem}" for p in package.glob("*.py") if 'if __name__ == "__main__"' in p.read_text()}
    assert {"meshtrain.train", "meshtrain.convert", "meshtrain.export", "meshtrain.plan"} <= cli_modules
    found = [(p.name, name) for p in package.rglob("*.py") for name in _imports(p) & cli_modules]
    assert found == []
    assert "meshtrain.trainer" not in _imports(package / "config.py")


def test_a_familys_model_code_imports_no_other_family():
    """A family's modules build on the shared floors (api, common, blocks, experts, the HF adapters'
    hf_decoder, kernels) and its own package, never on another family (issue 49)."""
    shared = {"models", "models.api", "models.common", "models.blocks", "models.experts", "models.hf_decoder"}
    found = []
    for family in ("llama", "moe", "deepseek"):
        for path in sorted((REPO / "models" / family).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("models"):
                    module = node.module
                    if not (module in shared or module.startswith(("models.kernels", f"models.{family}"))):
                        found.append(f"{path.relative_to(REPO)}: {module}")
    assert found == []
