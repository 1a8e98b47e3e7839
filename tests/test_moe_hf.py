"""Hugging Face interop of the MoE family (models/moe/hf.py): logits equal transformers'
MixtralForCausalLM and Qwen3MoeForCausalLM (norm_topk_prob both ways) on one device and on an
expert-parallel x tensor-parallel (2,2,2,1) mesh, experts read shard by shard, the load-balancing
loss equal transformers' where both define it alike, exact round trips both ways, a fine-tune's
first loss, logits and generation commands, and one-line errors for what is not supported.

Tolerances (fp32): logits absolute 1e-4 (about 1e-6 is measured), losses relative 1e-5,
load-balancing losses absolute 1e-6. transformers and torch are test extras; without them these tests skip.
"""

from __future__ import annotations

import collections
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from meshtrain import convert
from meshtrain.weights import hf, loading
from meshtrain.weights.export_format import save_params
from meshtrain.config import load_config, model_dict
from meshtrain.errors import ConfigError
from meshtrain.logits import compute_logits
from meshtrain.parallel.layout import abstract_model
from meshtrain.parallel.rules import Preset
from meshtrain.parallel.sharding import named_shardings
from meshtrain.loop import train
from models.api import AUX_LOSS
from models.moe import FAMILY as MOE
from models.moe import Dispatch, MoEConfig
from models.experts import load_balancing_loss, route
from hf_reference import (first_logged_and_transformers_loss, generate_cli_matches_transformers, hf_logits, hf_tensors,
                          random_norms, round_trip_through_hf, save_variants, torch, transformers)
from utils import mesh_of, random_params

ROOT = pathlib.Path(__file__).resolve().parents[1]
RULES = Preset.FSDP_TP.rules
EP_TP = (2, 2, 2, 1)  # experts over data x fsdp (4 ways), heads and expert hidden units over tensor
TOKENS = np.random.default_rng(0).integers(0, 96, (3, 20))  # 3 rows: padded on a 4-way batch split
# Distinct sizes within each model (embed != heads*head_dim != kv_heads*head_dim != expert hidden),
# and between the two, so that a transposed or swapped axis cannot pass. initializer_range 0.1 keeps
# router probabilities well apart, so that fp32 rounding cannot flip a top-k choice.
MIXTRAL = {"vocab_size": 96, "hidden_size": 40, "intermediate_size": 28, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 64, "initializer_range": 0.1,
           "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}}
QWEN3 = {"vocab_size": 112, "hidden_size": 48, "intermediate_size": 36, "moe_intermediate_size": 18,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10,
         "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 64, "initializer_range": 0.1}
VARIANTS = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, MIXTRAL),
    "qwen3": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {**QWEN3, "norm_topk_prob": False}),
    "qwen3_norm_tied": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                        {**QWEN3, "norm_topk_prob": True, "tie_word_embeddings": True}),
}


def _hf_model(variant: str, seed: int = 0):
    config_class, model_class, fields = VARIANTS[variant]
    torch.manual_seed(seed)
    return random_norms(model_class(config_class(**fields, experts_implementation="eager")).eval())  # q/k_norm too


def _from_pretrained(path: pathlib.Path):
    """transformers' model of ``path``, eager attention, and experts as a loop over the experts
    (the default grouped_mm needs 16-byte strides that these tiny sizes do not have)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each variant saved by transformers (Mixtral's per-expert tensors in sharded files) with its
    reference logits, and a bfloat16 copy of the Qwen3 one."""
    return save_variants(tmp_path_factory.mktemp("moe_hf"), _hf_model, VARIANTS, TOKENS, sharded="mixtral",
                         bf16="qwen3")


@pytest.mark.parametrize("variant, mesh_shape", [
    ("mixtral", (1, 1, 1, 1)), ("mixtral", EP_TP), ("qwen3", (1, 1, 1, 1)), ("qwen3", EP_TP),
    ("qwen3_norm_tied", EP_TP)])
def test_logits_match_transformers(hf_dirs, variant, mesh_shape):
    path, reference = hf_dirs[variant]
    model = loading.load_model(path, mesh_of(mesh_shape), RULES)
    cfg = model.cfg
    assert (cfg.qk_norm, cfg.dispatch, cfg.group_size) == (variant != "mixtral", Dispatch.DROPLESS, 0)
    assert cfg.norm_topk_prob is (variant != "qwen3") and cfg.tie_embeddings is (variant == "qwen3_norm_tied")
    if mesh_shape == EP_TP:  # each (data, fsdp) rank holds a quarter of the experts, half of each expert's units
        gate = model.params["layers"]["moe"]["gate"].get_value()
        assert {shard.data.shape for shard in gate.addressable_shards} == {
            (2, cfg.num_experts // 4, cfg.embed_dim, cfg.expert_mlp_dim // 2)}
    logits = compute_logits(model, TOKENS % cfg.vocab_size)
    assert logits.dtype == np.float32 and logits.shape == reference.shape
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


def test_experts_are_read_shard_by_shard(hf_dirs):
    """On (2,2,2,1) each device opens only the tensors of the experts it holds: each expert's w1 is read
    twice (by the two tensor ranks of its (data, fsdp) rank), half of it each time, never whole."""
    path, _ = hf_dirs["mixtral"]
    cfg = hf.model_config(hf.read_config(path))
    _, abstract = abstract_model(cfg)
    mesh = mesh_of(EP_TP)
    files = hf.SafetensorsFiles(path)
    hf.load_params(files, MOE.hf, cfg, abstract,
                   named_shardings(loading.inference_layout(cfg, mesh, RULES).param_specs(), mesh))
    w1 = [(name, size) for name, size in files.slices_read if name.endswith(".w1.weight")]
    assert collections.Counter(name for name, _ in w1) == {
        f"model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight": 2
        for layer in range(2) for expert in range(4)}
    assert {size for _, size in w1} == {28 * 40 // 2}


def test_per_expert_tensor_map_reads_any_sub_block():
    """A block of layers.moe.down (experts 2..5 of 8) read through one HF tensor per expert equals the
    slice of the stacked weights, and to_hf gives back each expert's tensor."""
    cfg = MoEConfig(embed_dim=40, num_experts=8, expert_mlp_dim=24)
    _, abstract = abstract_model(cfg)
    down = next(m for m in hf.tensor_maps(MOE.hf, cfg, abstract) if m.path == ("layers", "moe", "down"))
    assert (down.per_tensor, down.hf_shape) == (("experts",), (40, 24))
    ours = np.arange(8 * 24 * 40, dtype=np.float32).reshape(8, 24, 40)  # [experts, expert_mlp, expert_embed]
    opened = []

    class Files:
        def read(self, name, index):
            opened.append(name)
            return ours[int(name.split(".experts.")[1].split(".")[0])].T[index]

    block = {"experts": slice(2, 6), "expert_mlp": slice(3, 10), "expert_embed": slice(5, 30)}
    np.testing.assert_array_equal(down.read(Files(), 1, block), ours[2:6, 3:10, 5:30])
    assert opened == [f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight" for e in range(2, 6)]
    np.testing.assert_array_equal(down.to_hf(ours), ours.transpose(0, 2, 1))
    assert down.hf_tensors(2)[-1] == "model.layers.1.block_sparse_moe.experts.7.w2.weight"


@pytest.mark.parametrize("variant", ["mixtral", "qwen3"])
def test_load_balancing_loss_equals_transformers(hf_dirs, variant):
    """transformers' load_balancing_loss_func pools its token counts and probabilities over every token
    and layer it is given; ours is a per-routing-group, per-layer loss (a group is one row here).
    The two are defined alike for one sequence and one layer: compared there, layer by layer, on
    transformers' router logits and through our model's own (its layer-averaged statistic and the
    weighted sum over layers that enters the objective)."""
    path, _ = hf_dirs[variant]
    reference = _from_pretrained(path)
    sequence = TOKENS[:1]
    with torch.no_grad():
        router_logits = reference(torch.tensor(sequence), output_router_logits=True).router_logits
    func = sys.modules[type(reference).__module__].load_balancing_loss_func
    cfg = hf.model_config(hf.read_config(path))
    ours_of = jax.jit(
        lambda logits: load_balancing_loss(route(logits[None, None], cfg.top_k, cfg.norm_topk_prob))[0, 0])
    per_layer = []
    for layer_logits in router_logits:  # [tokens, experts]
        theirs = float(func((layer_logits,), cfg.num_experts, cfg.top_k))
        np.testing.assert_allclose(float(ours_of(layer_logits.numpy())), theirs, atol=1e-6, rtol=0)
        per_layer.append(theirs)
    model = loading.load_model(path, mesh_of((1, 1, 1, 1)), RULES)

    @jax.jit
    def aux_of(params: nnx.State, tokens: jax.Array) -> dict:
        module = nnx.merge(model.graphdef, params)
        return module.run_layers(module.embed(tokens, model.shard), model.shard)[1]

    with jax.default_matmul_precision("highest"):
        aux = aux_of(model.params, jax.numpy.asarray(sequence))
    np.testing.assert_allclose(float(aux["moe_load_balancing_loss"]), np.mean(per_layer), atol=1e-6, rtol=0)
    np.testing.assert_allclose(float(aux[AUX_LOSS]), cfg.load_balancing_coef * np.sum(per_layer), atol=1e-9, rtol=0)
    # router_aux_loss_coef weighs transformers' (about layer-averaged) loss; ours weighs the layer sum.
    assert cfg.load_balancing_coef * cfg.num_layers == pytest.approx(reference.config.router_aux_loss_coef)


@pytest.mark.parametrize("variant, mesh", [("mixtral", ["mesh.fsdp=4", "mesh.tensor=2"]), ("bf16", [])])
def test_hf_to_meshtrain_to_hf_reproduces_the_tensors(hf_dirs, tmp_path, variant, mesh):
    path, _ = hf_dirs[variant]
    assert convert.main(["from-hf", "--hf", str(path), "--out", str(tmp_path / "mt"), *mesh]) == 0
    assert convert.main(["to-hf", "--from", str(tmp_path / "mt"), "--out", str(tmp_path / "back"),
                         "--max-shard-size", "40KB", *mesh]) == 0
    before, after = hf_tensors(path), hf_tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert after[name].dtype == value.dtype, name
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    source, written = (json.loads((p / hf.CONFIG_FILE).read_text()) for p in (path, tmp_path / "back"))
    assert written["model_type"] == source["model_type"] and written["architectures"] == source["architectures"]
    assert written["router_aux_loss_coef"] == source["router_aux_loss_coef"]
    assert hf.model_config(written) == hf.model_config(source)


@pytest.mark.parametrize("qk_norm, norm_topk_prob, tied", [(False, True, False), (True, False, True)],
                         ids=["mixtral", "qwen3"])
def test_meshtrain_to_hf_to_meshtrain_is_bit_identical_and_loads_in_transformers(tmp_path, qk_norm,
                                                                                 norm_topk_prob, tied):
    cfg = MoEConfig(vocab_size=96, embed_dim=40, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=6,
                    num_experts=8, top_k=2, expert_mlp_dim=24, norm_topk_prob=norm_topk_prob, qk_norm=qk_norm,
                    tie_embeddings=tied, seq_len=32, rope_theta=20000.0, norm_eps=1e-6, load_balancing_coef=0.004)
    again = round_trip_through_hf(tmp_path, cfg, random_params(cfg), mesh_of(EP_TP))  # per-expert tensors, sharded
    reference = _from_pretrained(tmp_path / "hf")
    assert type(reference).__name__ == ("Qwen3MoeForCausalLM" if qk_norm else "MixtralForCausalLM")
    assert reference.config.router_aux_loss_coef == pytest.approx(0.008)
    np.testing.assert_allclose(compute_logits(again, TOKENS), hf_logits(reference.eval(), TOKENS),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("change, field", [
    ({"shared_mlp_dim": 16}, "model.shared_mlp_dim"),
    ({"norm_topk_prob": False}, "model.norm_topk_prob"),  # without qk_norm: Mixtral, which always renormalises
])
def test_export_refuses_what_neither_architecture_has(tmp_path, capsys, change, field):
    cfg = MoEConfig(**change)
    save_params(tmp_path / "mt", random_params(cfg), {"model": model_dict(cfg)})
    assert convert.main(["to-hf", "--from", str(tmp_path / "mt"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {field}: "), err
    assert not (tmp_path / "hf").exists()


@pytest.fixture(scope="module")
def finetune(hf_dirs, tmp_path_factory):
    """One fine-tune step from the Qwen3 checkpoint on (2,2,2,1) with checkpoint.init_from=hf:DIR and no
    auxiliary loss (transformers' loss is the cross-entropy alone unless output_router_logits)."""
    path, _ = hf_dirs["qwen3"]
    run_dir = tmp_path_factory.mktemp("moe_finetune")
    cfg = load_config(None, [
        "model.family=moe", "model.vocab_size=112", "model.embed_dim=48", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=10", "model.num_experts=8", "model.top_k=2",
        "model.expert_mlp_dim=18", "model.norm_topk_prob=false", "model.qk_norm=true", "model.norm_eps=1e-6",
        "model.seq_len=16", "model.load_balancing_coef=0", "train.steps=1", "train.batch_size=8",
        "train.log_every=1", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "run.tensorboard=false",
        f"run.dir={run_dir}", "checkpoint.enabled=false", f"checkpoint.init_from=hf:{path}"])
    train(cfg, devices=jax.devices()[:8])
    return cfg, run_dir, path


@pytest.mark.slow
def test_finetune_from_hf_starts_at_the_transformers_loss(finetune):
    cfg, run_dir, path = finetune
    first, expected = first_logged_and_transformers_loss(cfg, run_dir, _from_pretrained(path))
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


def test_init_from_hf_names_the_model_fields_to_change(hf_dirs, tmp_path):
    path, _ = hf_dirs["qwen3"]
    cfg = load_config(None, ["model.family=moe", "model.vocab_size=112", "model.embed_dim=48",
                             f"run.dir={tmp_path}", "checkpoint.enabled=false", f"checkpoint.init_from=hf:{path}"])
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert err.value.field == "checkpoint.init_from"
    assert ("set model.num_heads=4 model.num_kv_heads=2 model.head_dim=10 model.expert_mlp_dim=18 "
            "model.norm_topk_prob=false model.qk_norm=true") in err.value.message, err.value.message


def test_generate_cli_gives_transformers_greedy_tokens(hf_dirs, tmp_path):
    """meshtrain.generate on the Qwen3 checkpoint (fsdp over 8 devices: one expert each), KV cache and
    dropless routing of the prompt and of each new token, picks transformers' greedy tokens."""
    path, _ = hf_dirs["qwen3"]
    generate_cli_matches_transformers(path, _from_pretrained(path), tmp_path, vocab=112, new_tokens=6)


@pytest.mark.slow
def test_logits_cli_on_an_expert_parallel_mesh_matches_transformers(hf_dirs, tmp_path):
    path, reference = hf_dirs["mixtral"]
    np.save(tmp_path / "ids.npy", TOKENS)
    result = subprocess.run(
        [sys.executable, "-m", "meshtrain.logits", "--model", str(path), "--tokens", str(tmp_path / "ids.npy"),
         "--out", str(tmp_path / "logits.npy"), "--host-devices", "8", "mesh.data=2", "mesh.fsdp=2",
         "mesh.tensor=2"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant, change, key", [
    ("mixtral", {"sliding_window": -1}, "sliding_window"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, "layer_types": None},
     "max_window_layers"),
    ("qwen3", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope_parameters.rope_type"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ("qwen3", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ("qwen3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("qwen3", {"model_type": "qwen2_moe"}, "model_type"),
    ("mixtral", {"architectures": ["MixtralForSequenceClassification"]}, "architectures"),
])
def test_unsupported_hf_fields_are_one_line_errors(hf_dirs, tmp_path, capsys, variant, change, key):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((hf_dirs[variant][0] / hf.CONFIG_FILE).read_text())
    (bad / hf.CONFIG_FILE).write_text(json.dumps({**config, **change}))
    assert convert.main(["from-hf", "--hf", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: config.json:{key}: "), err


def test_shared_expert_tensors_are_an_error_not_dropped(hf_dirs, tmp_path, capsys):
    """A Qwen2-MoE-style shared expert and its gate in a checkpoint labelled qwen3_moe must not vanish."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(hf_dirs["qwen3"][0], tmp_path / "shared")
    weights = tmp_path / "shared" / hf.SINGLE_FILE
    tensors = load_file(str(weights))
    for layer in range(2):
        tensors[f"model.layers.{layer}.mlp.shared_expert.gate_proj.weight"] = np.zeros((16, 48), np.float32)
        tensors[f"model.layers.{layer}.mlp.shared_expert_gate.weight"] = np.zeros((1, 48), np.float32)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert convert.main(["from-hf", "--hf", str(tmp_path / "shared"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 4 tensors this model has no parameter for" in err, err
    assert "model.layers.0.mlp.shared_expert_gate.weight" in err and not (tmp_path / "out").exists()
