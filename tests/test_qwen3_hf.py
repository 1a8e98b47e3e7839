"""Hugging Face interop of Qwen3 dense checkpoints (``Qwen3ForCausalLM``, the Llama family with
``qk_norm``): a tiny random model converted with ``meshtrain.convert from-hf`` gives transformers'
logits on one device and on a (2,2,2,1) mesh (with a sliding window on every layer and tied
embeddings too), round trips are exact both ways, a fine-tune's first loss is transformers', and
what Qwen3 can hold but meshtrain does not implement is a one-line error.

Tolerances (fp32): logits absolute 1e-4, losses relative 1e-5. transformers and torch are test
extras; without them these tests skip. Compiles are kept few: the logits programs of the two
variants, one shared by the export test (the same shapes and mesh), and one train step.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from meshtrain import convert
from meshtrain.weights import hf, loading
from meshtrain.config import load_config
from meshtrain.errors import ConfigError
from meshtrain.logits import compute_logits
from meshtrain.loop import train
from meshtrain.parallel.layout import abstract_model
from meshtrain.parallel.rules import Preset
from models.blocks import RopeScaling
from models.llama import LlamaConfig
from hf_reference import (first_logged_and_transformers_loss, hf_logits, hf_tensors, random_norms,
                          round_trip_through_hf, save_variants, torch, transformers)
from utils import mesh_of, random_params

RULES = Preset.FSDP_TP.rules
MESH = (2, 2, 2, 1)  # data x fsdp x tensor: heads, kv_heads, mlp and vocab split over tensor
TOKENS = np.random.default_rng(0).integers(0, 104, (3, 20))  # 3 rows: padded on a 2-way batch split
# Distinct sizes (embed 48, heads*head_dim 56, kv_heads*head_dim 28, mlp 80, vocab 104) so that a
# transposed or swapped axis cannot pass; GQA (4 query heads share 2 key/value heads).
QWEN3 = {"vocab_size": 104, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 14, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "initializer_range": 0.1}
VARIANTS = {
    "qwen3": {"tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    # A window of 5 positions on every layer (max_window_layers 0), shorter than the 20-token rows;
    # rope_theta left out: transformers' default, 10000.
    "qwen3_tied_window": {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 5,
                          "max_window_layers": 0},
    # YaRN x4 over an original 8 positions (the rows hold 20): interpolated frequencies, cos and sin
    # times YaRN's attention factor 0.1 ln(4) + 1.
    "qwen3_yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                       "rope_theta": 1e4}},
}


def _hf_model(variant: str, seed: int = 0):
    """A random Qwen3ForCausalLM with random norm scales (q_norm and k_norm included: ones would hide them)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**QWEN3, **VARIANTS[variant], attn_implementation="eager")
    return random_norms(transformers.Qwen3ForCausalLM(config).eval())


def _from_pretrained(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each variant saved by transformers (the untied one in sharded files) with its reference logits,
    and a bfloat16 copy of the untied one."""
    return save_variants(tmp_path_factory.mktemp("qwen3_hf"), _hf_model, VARIANTS, TOKENS, sharded="qwen3",
                         bf16="qwen3")


@pytest.fixture(scope="module")
def exports(hf_dirs, tmp_path_factory):
    """{variant: the meshtrain export ``convert from-hf`` writes of it} (on its default mesh)."""
    root = tmp_path_factory.mktemp("qwen3_exports")
    for variant in (*VARIANTS, "bf16"):
        assert convert.main(["from-hf", "--hf", str(hf_dirs[variant][0]), "--out", str(root / variant)]) == 0
    return {variant: root / variant for variant in (*VARIANTS, "bf16")}


@pytest.mark.parametrize("variant, mesh_shape", [("qwen3", (1, 1, 1, 1)), ("qwen3", MESH),
                                                 ("qwen3_tied_window", MESH), ("qwen3_yarn", MESH)])
def test_converted_logits_match_transformers(hf_dirs, exports, variant, mesh_shape):
    _, reference = hf_dirs[variant]
    model = loading.load_model(exports[variant], mesh_of(mesh_shape), RULES)
    cfg = model.cfg
    assert cfg.qk_norm and (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 14)
    assert cfg.tie_embeddings is (variant == "qwen3_tied_window")
    assert (cfg.rope_theta, cfg.sliding_window) == {"qwen3": (1e6, 0), "qwen3_yarn": (1e4, 0)}.get(variant, (1e4, 5))
    assert cfg.rope_scaling.kind is (RopeScaling.YARN if variant == "qwen3_yarn" else RopeScaling.NONE)
    query_norm = np.asarray(model.params["layers"]["attention"]["query_norm"]["scale"].get_value())
    assert query_norm.shape == (2, 14) and np.abs(query_norm - 1).max() > 0.1  # the random scales arrived
    logits = compute_logits(model, TOKENS)
    assert logits.dtype == np.float32 and logits.shape == reference.shape
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["qwen3", "bf16", "qwen3_tied_window", "qwen3_yarn"])
def test_hf_to_meshtrain_to_hf_reproduces_the_tensors(hf_dirs, exports, tmp_path, variant):
    """Every tensor back bit for bit (q_norm and k_norm included) as Qwen3ForCausalLM, which transformers
    loads to the source's logits (the window written as use_sliding_window on every layer)."""
    path, reference = hf_dirs[variant]
    assert convert.main(["to-hf", "--from", str(exports[variant]), "--out", str(tmp_path / "back"),
                         "--max-shard-size", "40KB", "mesh.fsdp=4", "mesh.tensor=2"]) == 0
    before, after = hf_tensors(path), hf_tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    assert "model.layers.1.self_attn.k_norm.weight" in after
    for name, value in before.items():
        assert after[name].dtype == value.dtype, name
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    source, written = (json.loads((p / hf.CONFIG_FILE).read_text()) for p in (path, tmp_path / "back"))
    assert (written["model_type"], written["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert hf.model_config(written) == hf.model_config(source)
    if reference is not None:
        back = _from_pretrained(tmp_path / "back")
        assert back.config.layer_types == source["layer_types"]  # sliding_attention on every layer, or none
        np.testing.assert_allclose(hf_logits(back, TOKENS), reference, atol=1e-6, rtol=0)


def test_meshtrain_to_hf_to_meshtrain_is_bit_identical_and_loads_in_transformers(hf_dirs, tmp_path):
    """Random parameters (q/k norm scales around 1) of the windowed, tied Qwen3 shape, written as HF on
    (2,2,2,1), read back bit for bit; transformers' Qwen3ForCausalLM of the written files gives our
    logits. (The shapes and mesh of test_converted_logits_match_transformers: no new compile.)"""
    cfg = hf.model_config(hf.read_config(hf_dirs["qwen3_tied_window"][0]))
    assert isinstance(cfg, LlamaConfig) and cfg.qk_norm and cfg.sliding_window == 5
    again = round_trip_through_hf(tmp_path, cfg, random_params(cfg), mesh_of(MESH))
    reference = _from_pretrained(tmp_path / "hf")
    assert type(reference).__name__ == "Qwen3ForCausalLM"
    assert reference.config.layer_types == ["sliding_attention"] * 2 and reference.config.sliding_window == 5
    np.testing.assert_allclose(compute_logits(again, TOKENS), hf_logits(reference, TOKENS), atol=1e-4, rtol=0)


def test_parameter_count_includes_the_qk_norms():
    cfg = LlamaConfig(qk_norm=True)
    _, abstract = abstract_model(cfg)
    sizes = {".".join(map(str, path)): int(np.prod(v.shape)) for path, v in nnx.to_flat_state(abstract)}
    assert sum(sizes.values()) == cfg.num_params
    assert sizes["layers.attention.query_norm.scale"] == cfg.num_layers * cfg.head_dim
    plain = LlamaConfig()
    assert cfg.num_params - plain.num_params == 2 * cfg.num_layers * cfg.head_dim
    assert cfg.matmul_params == plain.matmul_params  # norms take part in no matmul


@pytest.fixture(scope="module")
def finetune(hf_dirs, tmp_path_factory):
    """One fine-tune step from the untied checkpoint on (2,2,2,1) with checkpoint.init_from=hf:DIR."""
    path, _ = hf_dirs["qwen3"]
    run_dir = tmp_path_factory.mktemp("qwen3_finetune")
    cfg = load_config(None, [
        "model.vocab_size=104", "model.embed_dim=48", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.head_dim=14", "model.mlp_dim=80", "model.qk_norm=true",
        "model.rope_theta=1000000.0", "model.norm_eps=1e-6", "model.seq_len=16", "train.steps=1",
        "train.batch_size=8", "train.log_every=1", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
        "run.tensorboard=false", f"run.dir={run_dir}", "checkpoint.enabled=false",
        f"checkpoint.init_from=hf:{path}"])
    train(cfg, devices=jax.devices()[:8])
    return cfg, run_dir, path


@pytest.mark.slow
def test_finetune_from_hf_starts_at_the_transformers_loss(finetune):
    cfg, run_dir, path = finetune
    first, expected = first_logged_and_transformers_loss(cfg, run_dir, _from_pretrained(path))
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


def test_init_from_hf_names_qk_norm(hf_dirs, tmp_path):
    """A Llama model section of the right shape without qk_norm does not fit a Qwen3 checkpoint."""
    path, _ = hf_dirs["qwen3"]
    cfg = load_config(None, ["model.vocab_size=104", "model.embed_dim=48", "model.num_heads=4",
                             "model.num_kv_heads=2", "model.head_dim=14", "model.mlp_dim=80",
                             "model.rope_theta=1000000.0", "model.norm_eps=1e-6", f"run.dir={tmp_path}",
                             "checkpoint.enabled=false", f"checkpoint.init_from=hf:{path}"])
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert err.value.field == "checkpoint.init_from"
    assert "qk_norm is False here but True there" in err.value.message and "set model.qk_norm=true" in err.value.message


def test_missing_keys_read_as_transformers_qwen3config_does():
    """head_dim 128 (not hidden / heads), 32 key/value heads, rms_norm_eps 1e-6, rope_theta 10000, and
    no window unless use_sliding_window (a sliding_window alone is not used)."""
    minimal = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 32, "sliding_window": 16}
    cfg = hf.model_config(minimal)
    theirs = transformers.Qwen3Config(**{k: v for k, v in minimal.items() if k != "model_type"})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.norm_eps) == (theirs.head_dim, theirs.num_key_value_heads,
                                                              theirs.rms_norm_eps) == (128, 32, 1e-6)
    assert cfg.rope_theta == theirs.rope_parameters["rope_theta"] == 10000.0
    assert cfg.sliding_window == 0 and set(theirs.layer_types) == {"full_attention"}
    windowed = hf.model_config({**minimal, "use_sliding_window": True, "max_window_layers": 0})
    assert windowed.sliding_window == 16 and windowed.qk_norm


@pytest.mark.parametrize("change, key", [
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
     "max_window_layers"),
    ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
     "layer_types"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.7, "rope_theta": 1e6}},
     "rope_parameters.attention_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures"),
])
def test_unsupported_qwen3_options_are_one_line_errors(hf_dirs, tmp_path, capsys, change, key):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((hf_dirs["qwen3"][0] / hf.CONFIG_FILE).read_text())
    (bad / hf.CONFIG_FILE).write_text(json.dumps({**config, **change}))
    assert convert.main(["from-hf", "--hf", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: config.json:{key}: "), err
    assert not (tmp_path / "out").exists()
