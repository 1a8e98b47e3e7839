"""An interleaved pipeline stores its layers in stage order; checkpoints and exports stay portable.

A run written under `interleaved` (2 stages x 2 virtual, 8 layers) resumes under GPipe and under no pipeline
with the losses of the uninterrupted run, and its export holds the layers in model order.
"""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from meshtrain.weights.export_format import PARAMS_DIR
from meshtrain.export import main as export_main
from meshtrain.train import main

COMMON = ["--config", "configs/tiny.yaml", "model.num_layers=8", "train.batch_size=16", "train.log_every=1",
          "run.tensorboard=false", "checkpoint.every=2", "checkpoint.async_save=false"]
INTERLEAVED = ["mesh.data=1", "mesh.stage=2", "pipeline.schedule=interleaved", "pipeline.virtual_stages=2",
               "pipeline.microbatches=4"]


def _losses(run_dir):
    return np.array([json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


@pytest.mark.slow
def test_interleaved_checkpoint_resumes_under_other_layouts_and_exports_in_model_order(tmp_path):
    """An interleaved run (layers stored chunk-interleaved) resumes from its step-2 checkpoint without
    a pipeline (layers in model order, as every other layout stores them) with the uninterrupted
    run's losses; the export of the interleaved run and that of the resumed run hold the same
    parameters (so the export is in model order)."""
    full = tmp_path / "full"
    assert main([*COMMON, *INTERLEAVED, "train.steps=4", f"run.dir={full}"]) == 0
    run = tmp_path / "sequential"
    restore = f"checkpoint.restore_from={full / 'checkpoints' / '2'}"
    assert main([*COMMON, "train.steps=4", f"run.dir={run}", restore]) == 0
    np.testing.assert_allclose(_losses(run), _losses(full)[2:], rtol=1e-5)
    exports = {}
    for name in ("full", "sequential"):
        assert export_main(["--run", str(tmp_path / name), "--out", str(tmp_path / f"{name}-export")]) == 0
        with ocp.StandardCheckpointer() as checkpointer:
            exports[name] = checkpointer.restore(tmp_path / f"{name}-export" / PARAMS_DIR)
    flat = lambda tree: {"/".join(map(str, path)): np.asarray(leaf)
                         for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    interleaved, sequential = flat(exports["full"]), flat(exports["sequential"])
    assert interleaved.keys() == sequential.keys()
    for name, expected in sequential.items():
        np.testing.assert_allclose(interleaved[name], expected, atol=1e-5, err_msg=name)
