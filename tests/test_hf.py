"""Hugging Face interop: logits equal transformers' LlamaForCausalLM (one device and a (1,2,2,1)
mesh, GQA, tied embeddings, llama3 rope scaling), exact round trips both ways, shards read in
place, KV-cache generation equal to full recompute, fine-tune from an HF checkpoint, and errors.

transformers and torch are test extras (``pip install -e '.[dev]'``); without them these tests skip.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from meshtrain import convert, generate
from meshtrain.weights import hf, loading
from meshtrain.errors import ConfigError
from meshtrain.logits import compute_logits
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.parallel.layout import abstract_model
from meshtrain.parallel.sharding import named_shardings
from models.blocks import RopeScaling, RopeScalingConfig
from models.llama import FAMILY as LLAMA
from models.llama import Llama, LlamaConfig
from hf_reference import (LLAMA3, RULES, TOKENS, VARIANTS, hf_logits, hf_tensors, llama_model, round_trip_through_hf,
                          save_variants, transformers)
from utils import mesh_of

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each variant saved by transformers (the GQA one in sharded files), its reference logits, and a
    bfloat16 copy of the tied one."""
    return save_variants(tmp_path_factory.mktemp("hf"), llama_model, VARIANTS, TOKENS, sharded="gqa",
                         bf16="tied_llama3")


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1, 1), (1, 2, 2, 1)], ids=["1dev", "1x2x2x1"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(hf_dirs, variant, mesh_shape):
    path, reference = hf_dirs[variant]
    model = loading.load_model(path, mesh_of(mesh_shape), RULES)
    assert model.cfg.tie_embeddings is (variant == "tied_llama3")
    assert model.cfg.rope_scaling.kind is (RopeScaling.LLAMA3 if variant == "tied_llama3" else RopeScaling.NONE)
    assert model.cfg.sliding_window == VARIANTS[variant].get("sliding_window", 0)
    logits = compute_logits(model, TOKENS)
    assert logits.dtype == np.float32 and logits.shape == reference.shape
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


def test_shards_are_read_straight_into_their_devices(hf_dirs):
    """On fsdp=2 x tensor=2 each callback reads a quarter of q_proj and of the embedding, never all."""
    path, _ = hf_dirs["gqa"]
    cfg = hf.model_config(hf.read_config(path))
    _, abstract = abstract_model(cfg)
    mesh = mesh_of((1, 2, 2, 1))
    files = hf.SafetensorsFiles(path)
    params = hf.load_params(files, LLAMA.hf, cfg, abstract,
                            named_shardings(loading.inference_layout(cfg, mesh, RULES).param_specs(), mesh))
    query = params["layers"]["attention"]["query"].get_value()
    assert {shard.data.shape for shard in query.addressable_shards} == {(2, 32, 2, 16)}
    reads = {}
    for name, size in files.slices_read:
        reads.setdefault(name.split(".", 3)[-1] if "layers" in name else name, set()).add(size)
    assert reads["self_attn.q_proj.weight"] == {64 * 64 // 4}
    assert reads["model.embed_tokens.weight"] == {128 * 64 // 4}


@pytest.mark.parametrize("variant", ["gqa", "bf16", "mistral_window"])
def test_hf_to_meshtrain_to_hf_reproduces_the_tensors(hf_dirs, tmp_path, variant):
    """Every tensor back bit for bit; the sliding window back as Mistral's ``sliding_window``."""
    path, _ = hf_dirs[variant]
    assert convert.main(["from-hf", "--hf", str(path), "--out", str(tmp_path / "mt")]) == 0
    assert convert.main(["to-hf", "--from", str(tmp_path / "mt"), "--out", str(tmp_path / "back"),
                         "--max-shard-size", "40KB"]) == 0
    before, after = hf_tensors(path), hf_tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert after[name].dtype == value.dtype, name
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert (tmp_path / "back" / "generation_config.json").is_file()  # side files travel along
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["sliding_window"] == VARIANTS.get(variant, {}).get("sliding_window")
    assert config["model_type"] == ("mistral" if variant == "mistral_window" else "llama")


def test_meshtrain_to_hf_to_meshtrain_is_bit_identical_and_loads_in_transformers(tmp_path):
    """Distinct sizes (embed 40 != heads*head_dim 48) so a transposed axis cannot pass; llama3 rope."""
    cfg = LlamaConfig(vocab_size=96, embed_dim=40, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=6,
                      mlp_dim=72, seq_len=32, rope_theta=20000.0, norm_eps=1e-6,
                      rope_scaling=RopeScalingConfig(kind=RopeScaling.LLAMA3, original_max_len=16))
    params = nnx.state(Llama(cfg, rngs=nnx.Rngs(3)), nnx.Param)
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), params)
    again = round_trip_through_hf(tmp_path, cfg, params, mesh_of((1, 2, 2, 1)))
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    tokens = TOKENS[:, :20] % cfg.vocab_size
    np.testing.assert_allclose(compute_logits(again, tokens), hf_logits(reference.eval(), tokens),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["tied_llama3", "mistral_window"])
def test_kv_cache_generation_equals_full_recompute(hf_dirs, variant):
    """Greedy tokens from the KV cache equal the full model's; the windowed model's cache attends
    only the window, as its full forward does."""
    model = loading.load_model(hf_dirs[variant][0], mesh_of((1, 1, 1, 1)), RULES)
    prompt = TOKENS[:2, :5]
    cached = generate.generate_tokens(model.graphdef, model.params, prompt, 12)
    # The full model on the growing sequence; causal, so zeros after it change nothing (one compile).
    forward = jax.jit(lambda params, tokens: nnx.merge(model.graphdef, params)(tokens))
    sequence = np.zeros((2, 5 + 12), np.int32)
    sequence[:, :5] = prompt
    for length in range(5, 5 + 12):
        sequence[:, length] = np.argmax(np.asarray(forward(model.params, sequence))[:, length - 1], axis=-1)
    np.testing.assert_array_equal(cached, sequence[:, 5:])
    sampled = [generate.generate_tokens(model.graphdef, model.params, prompt, 6, temperature=1.0, seed=s)
               for s in (1, 2)]
    assert not np.array_equal(sampled[0], sampled[1]) and sampled[0].max() < 128


def test_generate_cli_with_an_hf_tokenizer(hf_dirs, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(126)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    source, _ = hf_dirs["gqa"]
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    printed = []
    argv = ["--hf", str(source), "--prompt", "w3 w7 w9", "--max-new-tokens", "4",
            "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert generate.main(argv, print_fn=printed.append) == 0
    model = loading.load_model(source, make_mesh(MeshConfig()), RULES)
    ids = generate.generate_tokens(model.graphdef, model.params, np.array([[5, 9, 11]]), 4)[0]
    ids = list(ids[: list(ids).index(2)]) if 2 in ids else list(ids)  # generation_config's eos_token_id 2
    assert printed == ["w3 w7 w9" + tokenizer.decode([int(i) for i in ids])]


def test_byte_tokenizer_round_trips_utf8():
    tokenizer = generate.ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"


BASE = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.mark.parametrize("change, field", [
    ({"model_type": "gpt2"}, "config.json:model_type"),
    ({"attention_bias": True}, "config.json:attention_bias"),
    ({"mlp_bias": True}, "config.json:mlp_bias"),
    ({"model_type": "mistral", "sliding_window": 0}, "config.json:sliding_window"),
    ({"model_type": "mistral", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1},
     "config.json:max_window_layers"),
    ({"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}, "config.json:layer_types"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "config.json:rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "config.json:rope_parameters.rope_type"),
    ({"hidden_act": "gelu"}, "config.json:hidden_act"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "config.json:architectures"),
    ({"architectures": "LlamaForCausalLM"}, "config.json:architectures"),  # a string, not a list
])
def test_unsupported_configs_name_the_field(change, field):
    with pytest.raises(ConfigError) as err:
        hf.model_config({**BASE, **change})
    assert err.value.field == field


def test_supported_config_spellings():
    mistral = hf.model_config({**BASE, "model_type": "mistral", "sliding_window": None, "num_key_value_heads": 2})
    assert (mistral.num_kv_heads, mistral.head_dim, mistral.sliding_window) == (2, 16, 0)
    assert hf.model_config({**BASE, "model_type": "mistral", "sliding_window": 4096}).sliding_window == 4096
    old_style = hf.model_config({**BASE, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                                 "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192}})
    assert old_style.rope_theta == 500000.0
    assert old_style.rope_scaling == RopeScalingConfig(kind=RopeScaling.LLAMA3, original_max_len=8192)


def test_cli_errors_are_one_line(hf_dirs, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((hf_dirs["gqa"][0] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    assert convert.main(["from-hf", "--hf", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: config.json:attention_bias: ")
    assert convert.main(["to-hf", "--from", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("error: --from: no such directory")


def test_logits_cli_on_a_mesh_matches_transformers(hf_dirs, tmp_path):
    path, reference = hf_dirs["gqa"]
    np.save(tmp_path / "ids.npy", TOKENS)
    result = subprocess.run(
        [sys.executable, "-m", "meshtrain.logits", "--model", str(path), "--tokens", str(tmp_path / "ids.npy"),
         "--out", str(tmp_path / "logits.npy"), "--host-devices", "4", "mesh.fsdp=2", "mesh.tensor=2"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), reference, atol=1e-4, rtol=0)


def test_tensor_map_reads_any_sub_block():
    """Reading a block of query through the HF layout equals slicing the mapped full tensor."""
    cfg = LlamaConfig(embed_dim=40, num_heads=8, num_kv_heads=4, head_dim=6)
    _, abstract = abstract_model(cfg)
    query = next(m for m in hf.tensor_maps(LLAMA.hf, cfg, abstract) if m.path == ("layers", "attention", "query"))
    full_hf = np.arange(np.prod(query.hf_shape), dtype=np.float32).reshape(query.hf_shape)

    class Files:
        def read(self, name, index):
            return full_hf[index]

    ours = full_hf.reshape(8, 6, 40).transpose(2, 0, 1)
    block = {"embed": slice(10, 30), "heads": slice(2, 6), "head_dim": slice(1, 4)}
    np.testing.assert_array_equal(query.read(Files(), 0, block), ours[10:30, 2:6, 1:4])
    np.testing.assert_array_equal(query.to_hf(ours), full_hf)
    assert dataclasses.replace(query).hf_tensor(1) == "model.layers.1.self_attn.q_proj.weight"


def test_tensors_no_parameter_takes_are_an_error_not_dropped(hf_dirs, tmp_path, capsys):
    """Issue 12 item 12: q/k/v biases (a Qwen2 checkpoint labelled llama) must not vanish on import."""
    from safetensors.numpy import load_file, save_file

    source = hf_dirs["tied_llama3"][0]
    shutil.copytree(source, tmp_path / "qwen_like")
    weights = tmp_path / "qwen_like" / "model.safetensors"
    tensors = load_file(str(weights))
    for layer in range(2):
        for proj in ("q_proj", "k_proj"):
            tensors[f"model.layers.{layer}.self_attn.{proj}.bias"] = np.zeros(64 if proj == "q_proj" else 32,
                                                                                np.float32)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert convert.main(["from-hf", "--hf", str(tmp_path / "qwen_like"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 4 tensors this model has no parameter for" in err, err
    assert "model.layers.0.self_attn.k_proj.bias" in err and not (tmp_path / "out").exists()
