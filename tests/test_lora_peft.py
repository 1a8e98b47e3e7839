"""A LoRA fine-tune of an HF checkpoint, exported both ways the ecosystem reads: its adapters as a PEFT
directory that ``peft.PeftModel.from_pretrained`` loads onto the transformers base with meshtrain's
logits, and the merged model as an HF checkpoint; the adapter read back continues training from the
PEFT model's loss."""

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

peft = pytest.importorskip("peft")

MODEL = ["model.vocab_size=128", "model.embed_dim=64", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=96", "model.seq_len=16",
         "model.rope_theta=50000.0", "model.norm_eps=1e-6"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gqa"
    llama_model("gqa").save_pretrained(path)
    return path


def _lora_run(run_dir, hf_dir, *extra):
    cfg = load_config(None, [*MODEL, "train.steps=2", "train.batch_size=8", "train.log_every=1", "mesh.data=1",
                             "mesh.fsdp=2", "mesh.tensor=2", "run.tensorboard=false", f"run.dir={run_dir}",
                             "checkpoint.every=0", f"checkpoint.init_from=hf:{hf_dir}", "train.lora.rank=4",
                             "train.lora.alpha=8", "optimizer.learning_rate=0.02", "optimizer.warmup_steps=0", *extra])
    train(cfg, devices=jax.devices()[:4])
    return cfg


@pytest.fixture(scope="module")
def lora_run(hf_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora")
    return _lora_run(run_dir, hf_dir), run_dir


@pytest.fixture(scope="module")
def adapter_dir(lora_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("peft") / "adapter"
    assert convert.to_peft(str(lora_run[1]), str(out), mesh_of((1, 1, 1, 1)), RULES) == [
        "adapter_config.json", "adapter_model.safetensors"]
    return out


def _peft_model(hf_dir, adapter_dir):
    base = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


def test_peft_loads_the_adapter_with_meshtrains_logits(hf_dir, lora_run, adapter_dir):
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"])
    assert config["base_model_name_or_path"] == str(hf_dir)
    ours = compute_logits(loading.load_model(lora_run[1], mesh_of((1, 1, 1, 1)), RULES), TOKENS)
    theirs = hf_logits(_peft_model(hf_dir, adapter_dir), TOKENS)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    base = hf_logits(transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval(),
                      TOKENS)
    assert np.abs(theirs - base).max() > 1e-2  # the adapter changed the model


def test_merged_export_is_the_peft_model(hf_dir, lora_run, adapter_dir, tmp_path):
    convert.to_hf(str(lora_run[1]), str(tmp_path / "merged"), mesh_of((1, 1, 1, 1)), RULES)
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(merged.eval(), TOKENS), hf_logits(_peft_model(hf_dir, adapter_dir), TOKENS),
                               atol=1e-4, rtol=0)


def test_training_continues_from_a_peft_adapter(hf_dir, adapter_dir, tmp_path):
    cfg = _lora_run(tmp_path, hf_dir, f"train.lora.init_from={adapter_dir}")
    first, expected = first_logged_and_transformers_loss(cfg, tmp_path, _peft_model(hf_dir, adapter_dir))
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


def test_an_adapter_of_another_rank_is_one_line_naming_the_field(hf_dir, adapter_dir, tmp_path):
    cfg = load_config(None, [*MODEL, f"run.dir={tmp_path}", "checkpoint.enabled=false", "train.lora.rank=8",
                             f"train.lora.init_from={adapter_dir}", "mesh.fsdp=1"])
    with pytest.raises(ConfigError) as err:
        train(cfg, devices=jax.devices()[:1])
    assert err.value.field == "train.lora.init_from"
    assert "r is 4" in str(err.value) and "\n" not in str(err.value)
