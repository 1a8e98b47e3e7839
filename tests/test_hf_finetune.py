"""Fine-tuning from a Hugging Face checkpoint with ``checkpoint.init_from=hf:DIR``: the first
loss equals transformers' on the same batch; a model section that does not fit is a one-line error
naming the overrides that fix it."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from meshtrain import convert
from meshtrain.weights import loading
from meshtrain.config import load_config
from meshtrain.errors import ConfigError
from meshtrain.logits import compute_logits
from meshtrain.loop import train
from hf_reference import (RULES, TOKENS, first_logged_and_transformers_loss, hf_logits, llama_model,
                          transformers)
from utils import mesh_of


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gqa"
    llama_model("gqa").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def finetune(hf_dir, tmp_path_factory):
    """Two fine-tune steps from the GQA checkpoint on (1,2,2,1) with checkpoint.init_from=hf:DIR."""
    run_dir = tmp_path_factory.mktemp("finetune")
    cfg = load_config(None, [
        "model.vocab_size=128", "model.embed_dim=64", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=96", "model.seq_len=16",
        "model.rope_theta=50000.0", "model.norm_eps=1e-6", "train.steps=2", "train.batch_size=8",
        "train.log_every=1", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "run.tensorboard=false",
        f"run.dir={run_dir}", "checkpoint.every=0", f"checkpoint.init_from=hf:{hf_dir}"])
    train(cfg, devices=jax.devices()[:4])
    return cfg, run_dir


def test_finetune_from_hf_starts_at_the_transformers_loss(hf_dir, finetune):
    cfg, run_dir = finetune
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    first, expected = first_logged_and_transformers_loss(cfg, run_dir, model)
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(expected, rel=1e-5)



def test_finetuned_run_exports_to_hf(finetune, tmp_path):
    """The run's final checkpoint, written as HF files, gives transformers the logits meshtrain gives."""
    _, run_dir = finetune
    mesh = mesh_of((1, 1, 1, 1))
    model = loading.load_model(run_dir, mesh, RULES)
    assert model.kind is convert.SourceKind.RUN
    convert.to_hf(str(run_dir), str(tmp_path / "hf"), mesh, RULES)
    # Issue 12 item 13: the source's max_position_embeddings (64) is kept, not the run's seq_len (16).
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == 64
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    np.testing.assert_allclose(compute_logits(model, TOKENS), hf_logits(exported.eval(), TOKENS),
                               atol=1e-4, rtol=0)


def test_init_from_hf_names_the_model_fields_to_change(hf_dir, tmp_path):
    cfg = load_config(None, ["model.vocab_size=128", f"run.dir={tmp_path}", "checkpoint.enabled=false",
                             f"checkpoint.init_from=hf:{hf_dir}"])
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert err.value.field == "checkpoint.init_from"
    assert "set model.embed_dim=64 model.num_heads=4 model.num_kv_heads=2 model.head_dim=16" in err.value.message
