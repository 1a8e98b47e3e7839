"""The DeepSeek-V3 family (models/deepseek): every layout equals one device (loss, gradients and
the experts' statistics, multi-token prediction included, fp32: loss rel 1e-5, each gradient's
relative L2 error < 1e-5), multi-token prediction's loss equals a reference built from its pieces,
the compressed cache holds ``kv_lora_rank + qk_rope_head_dim`` values per token and layer and its
generation equals the uncached forward, group-limited routing equals a for-loop reference, and the
config's one-line errors."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain.data import DataConfig, global_batch, make_dataset
from meshtrain.loss import documents_of
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.parallel.activations import activation_sharding
from meshtrain.parallel.zero import ZeroConfig, ZeroStage
from models.api import family_named, forward
from models.blocks import RopeScaling, RopeScalingConfig, rotary_tables
from models.common import InvalidField, unconstrained
from models.deepseek import DeepSeek, DeepSeekConfig
from models.experts import RouterScore, route
from utils import (initial_state, logits_alone, loss_grads_and_statistics, make_trainer, one_line_error, packed_dataset,
                   relative_l2)

# Distinct sizes: embed 40, q latent 24, kv latent 16, nope 8 + rope 4 = qk 12 != v 6, 8 experts of
# 16 hidden units in 4 groups, dense hidden 56. One dense layer, then two MoE layers; YaRN rotary.
DEEPSEEK = DeepSeekConfig(vocab_size=96, embed_dim=40, num_layers=2, num_dense_layers=1, num_heads=4, q_lora_rank=24,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, mlp_dim=56,
                          num_experts=8, top_k=2, expert_mlp_dim=16, num_shared_experts=1, expert_groups=4,
                          groups_per_token=2, routed_scaling_factor=2.5, seq_len=32, load_balancing_coef=0.01,
                          rope_scaling=RopeScalingConfig(kind=RopeScaling.YARN, factor=4.0, original_max_len=8,
                                                         mscale=1.0, mscale_all_dim=1.0),
                          rope_interleave=True, mtp_layers=1, mtp_loss_coef=0.3)


@pytest.fixture(scope="module")
def reference():
    return loss_grads_and_statistics(make_trainer((1, 1, 1, 1), DEEPSEEK))


LAYOUTS = [
    pytest.param((2, 2, 2, 1), {}, id="ep4-fsdp-tp2"),
    pytest.param((4, 1, 2, 1), {}, id="ep4-tp2", marks=pytest.mark.slow),
    pytest.param((2, 1, 1, 2), {"pipeline": PipelineConfig(2, Schedule.ONE_F_ONE_B)}, id="ep2-stage2-1f1b",
                 marks=pytest.mark.slow),  # the fast tier's pipelines: tests/test_pipeline.py
    pytest.param((2, 2, 2, 1), {"rules": Preset.FSDP_TP_SP.rules}, id="sp-ep4-tp2", marks=pytest.mark.slow),
    pytest.param((1, 8, 1, 1), {"zero": ZeroConfig(ZeroStage.OPTIMIZER)}, id="zero1-ep8", marks=pytest.mark.slow),
]


def _assert_equal(reference, result):
    ref_loss, ref_grads, ref_stats = reference
    loss, grads, stats = result
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    assert any(name.startswith("dense_layers.") for name in grads) and "layers.moe.routing_bias" in grads
    for name, expected in ref_grads.items():
        assert relative_l2(grads[name], expected) < 1e-5, name
    assert stats.keys() == ref_stats.keys()
    for name, expected in ref_stats.items():
        np.testing.assert_allclose(stats[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("mesh_shape, fields", LAYOUTS)
def test_layouts_equal_one_device(reference, mesh_shape, fields):
    _assert_equal(reference, loss_grads_and_statistics(make_trainer(mesh_shape, DEEPSEEK, **fields)))


@pytest.mark.slow
@pytest.mark.parametrize("preset", [Preset.FSDP_CP, Preset.FSDP_CP_RING], ids=["cp_all_gather", "cp_ring_balanced"])
def test_context_parallelism_equals_one_device(reference, preset):
    """Latent attention's expanded keys under context parallelism over 4 devices; under the ring
    the positions are permuted (balanced), and multi-token prediction's targets follow the tokens."""
    _assert_equal(reference, loss_grads_and_statistics(make_trainer((1, 4, 1, 1), DEEPSEEK, rules=preset.rules)))


@pytest.mark.slow  # the fast tier's packed documents: tests/test_packing.py
def test_packed_documents_equal_each_document_alone_and_one_device():
    """Rows packed from documents: the logits on (2,2,2,1) equal each document run alone, and the
    loss and gradients (multi-token prediction masked at document ends) equal one device's."""
    trainer = make_trainer((2, 2, 2, 1), DEEPSEEK, batch_size=8)
    batch = global_batch(packed_dataset(), 0, 8, trainer.batch_sharding)
    params = initial_state(trainer).params
    shard = activation_sharding(trainer.rules, trainer.mesh)
    logits = jax.jit(lambda p, b: forward(trainer._model_of(p), b["inputs"], shard, documents_of(b)))(params, batch)
    host = {key: np.asarray(value) for key, value in batch.items()}
    reference = logits_alone(jax.device_get(params), trainer.graphdef, host["inputs"], host["segments"])
    valid = host["segments"] > 0
    # fp32 rounding of three layers and two routings: 1.0e-5 measured at logits of magnitude ~2.4
    np.testing.assert_allclose(np.asarray(logits)[valid], reference[valid], atol=2e-5, rtol=0)
    one = make_trainer((1, 1, 1, 1), DEEPSEEK, batch_size=8)
    _assert_equal(loss_grads_and_statistics(one, global_batch(packed_dataset(), 0, 8, one.batch_sharding)),
                  loss_grads_and_statistics(trainer, batch))


FOUR_LAYERS = dataclasses.replace(DEEPSEEK, num_layers=4, mtp_layers=2)


@pytest.mark.slow
def test_two_prediction_depths_in_an_interleaved_pipeline_equal_one_device(four_layer_reference):
    """Four MoE layers and two prediction depths, interleaved (2 stages x 2 virtual) with tensor
    parallelism. The depths run with the head on the last stage in every schedule (the executor's
    ``ahead_step``, outside the schedule's layer tasks), so one schedule proves them; one depth under
    1F1B is ``test_layouts_equal_one_device[ep2-stage2-1f1b]``."""
    assert "mtp.project" in four_layer_reference[1] and four_layer_reference[2]["mtp_loss"] > 0
    pipeline = PipelineConfig(2, Schedule.INTERLEAVED, virtual_stages=2)
    _assert_equal(four_layer_reference,
                  loss_grads_and_statistics(make_trainer((1, 1, 2, 2), FOUR_LAYERS, pipeline=pipeline)))


@pytest.fixture(scope="module")
def four_layer_reference():
    return loss_grads_and_statistics(make_trainer((1, 1, 1, 1), FOUR_LAYERS))


def _model(cfg: DeepSeekConfig = DEEPSEEK, seed: int = 0) -> DeepSeek:
    return family_named("deepseek").build(cfg, seed)


@pytest.mark.slow  # the fast tier's prediction depth: the ep4-fsdp-tp2 layout, whose loss includes it
def test_multi_token_prediction_is_in_the_objective_and_its_metric(reference):
    """The step's loss = the main cross-entropy + the layers' aux losses + 0.3 x depth 1's
    cross-entropy of token t+2 (+ its layer's aux loss), and ``mtp_loss`` is that cross-entropy:
    depth 1 rebuilt here from its pieces (norms, eh_proj, the MoE layer, the shared head) with the
    shift written out."""
    trainer = make_trainer((1, 1, 1, 1), DEEPSEEK)
    loss, _, stats = reference
    model = trainer._model_of(initial_state(trainer).params)
    batch = make_dataset(DataConfig(), vocab_size=96, seq_len=32).rows(np.arange(trainer.layout.train.batch_size))
    inputs, targets = jnp.asarray(batch["inputs"]), np.asarray(batch["targets"])
    x, aux = model.run_layers(model.embed(inputs))
    ce = lambda logits, t: -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), t[..., None], -1)[..., 0]
    main = ce(model.logits(x), targets)
    depth = jax.tree.map(lambda a: a[0], model.mtp)  # the one prediction depth
    later = jnp.concatenate([inputs[:, 1:], inputs[:, :1]], axis=1)  # token t + 1 at position t
    combined = jnp.einsum("btie,ied->btd", jnp.stack([depth.embed_norm(model.embedding[...][later]),
                                                      depth.hidden_norm(x)], axis=2), depth.project[...])
    positions = jnp.arange(32)[None]
    rotary = rotary_tables(positions, DEEPSEEK.head_dim, DEEPSEEK.rope_theta, DEEPSEEK.rope_scaling)
    h, layer_stats = depth.layer(combined, rotary, positions, None, unconstrained)
    ahead = ce(model.vocab_logits(depth.head_norm(h)), np.roll(targets, -1, axis=1))[:, :-1]  # t+2 exists
    mtp = ahead.sum() / main.size
    np.testing.assert_allclose(stats["mtp_loss"], mtp, rtol=1e-5)
    rows = targets.shape[0]
    layer_aux = float(aux["loss"]) + DEEPSEEK.load_balancing_coef * float(jnp.sum(layer_stats["load_balancing"]))
    np.testing.assert_allclose(loss, main.mean() + 0.3 * mtp + layer_aux / rows, rtol=1e-5)


@pytest.mark.slow  # the fast tier's DeepSeek generation: test_generate_cli_gives_transformers_greedy_tokens
def test_the_cache_is_compressed_and_generation_equals_the_uncached_forward():
    """The cache keeps kv_lora_rank + qk_rope_head_dim = 20 values per token and layer (a full
    cache would keep 2 * heads * 12 = 96 keys and values); prefill + one token at a time equals the
    uncached logits and greedy tokens."""
    model = _model()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, DEEPSEEK.vocab_size, (2, 20)))
    cache = model.init_cache(2, 20)
    layers = DEEPSEEK.num_dense_layers + DEEPSEEK.num_layers
    per_token_and_layer = sum(leaf.size for leaf in jax.tree.leaves(cache)) / (2 * 20 * layers)
    assert per_token_and_layer == DEEPSEEK.kv_lora_rank + DEEPSEEK.qk_rope_head_dim == 20
    assert cache.latents.shape == (2, 2, 20, 16) and cache.dense_rope_keys.shape == (1, 2, 20, 4)
    full = np.asarray(forward(model, tokens, unconstrained))
    prefill, cache = model.cached_forward(tokens[:, :12], cache, jnp.int32(0))
    steps = [prefill]
    for position in range(12, 20):
        logits, cache = model.cached_forward(tokens[:, position:position + 1], cache, jnp.int32(position))
        steps.append(logits)
    cached = np.concatenate([np.asarray(step) for step in steps], axis=1)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=0)
    assert (cached.argmax(-1) == full.argmax(-1)).all()


def test_group_limited_routing_equals_a_for_loop_reference():
    """Each token's experts come from its 2 best of 4 groups (a group scored by its two best biased
    scores), chosen by biased sigmoid scores, weighted by the unbiased ones renormalised x 2.5."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 1, 16, 8)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=8).astype(np.float32)
    routing = route(jnp.asarray(logits), 2, True, RouterScore.SIGMOID, jnp.asarray(bias), 4, 2, 2.5)
    for b, s in np.ndindex(2, 16):
        scores = 1 / (1 + np.exp(-logits[b, 0, s]))
        biased = scores + bias
        group_scores = [np.sort(biased[g * 2:(g + 1) * 2]).sum() for g in range(4)]
        groups = np.argsort(group_scores)[::-1][:2]
        allowed = [e for e in range(8) if e // 2 in groups]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:2]
        weights = scores[chosen] / scores[chosen].sum() * 2.5
        assert list(np.asarray(routing.experts[b, 0, s])) == chosen
        np.testing.assert_allclose(np.asarray(routing.weights[b, 0, s]), weights, rtol=1e-6)


def test_parameter_count_is_the_config_formula():
    params = nnx.state(_model())
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == DEEPSEEK.num_params


@pytest.mark.parametrize("fields, field", [
    ({"expert_groups": 3}, "expert_groups"),
    ({"groups_per_token": 5}, "groups_per_token"),
    ({"top_k": 5}, "top_k"),  # 2 groups of 2 experts reach 4
    ({"qk_rope_head_dim": 5}, "qk_rope_head_dim"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
])
def test_invalid_fields_are_named(fields, field):
    with pytest.raises(InvalidField) as err:
        dataclasses.replace(DEEPSEEK, **fields)
    assert err.value.field == field


# --- Hugging Face interop ----------------------------------------------------------------------------

transformers = pytest.importorskip("transformers", reason="transformers is not installed (a test extra)")
torch = pytest.importorskip("torch", reason="torch is not installed (a test extra)")

from hf_reference import (first_logged_and_transformers_loss, generate_cli_matches_transformers,  # noqa: E402
                          hf_logits, random_norms, round_trip_through_hf)
from utils import mesh_of  # noqa: E402

from meshtrain import convert  # noqa: E402
from meshtrain.weights import hf, loading  # noqa: E402
from meshtrain.config import load_config, model_dict  # noqa: E402
from meshtrain.errors import ConfigError  # noqa: E402
from meshtrain.loop import train  # noqa: E402
from meshtrain.logits import compute_logits  # noqa: E402

RULES = Preset.FSDP_TP.rules
TOKENS = np.random.default_rng(0).integers(0, 96, (3, 20))
HF_SHAPE = dict(vocab_size=96, hidden_size=40, intermediate_size=56, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, num_experts_per_tok=2,
                first_k_dense_replace=1, max_position_embeddings=64, num_mtp_layers=0, initializer_range=0.1)
VARIANTS = {
    # q-LoRA, 4 groups of which 2 per token, scaled gates, YaRN with mscale, interleaved rotary pairs.
    "qlora_yarn": dict(q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_interleave=True,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "rope_theta": 10000.0}),
    # A plain query projection, one group, unnormalised gates, half-split rotary.
    "plain_query": dict(q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                        rope_interleave=False),
}


def _hf_deepseek(variant: str, seed: int = 0, shape: dict = HF_SHAPE):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**shape, **VARIANTS[variant], attn_implementation="eager")
    model = random_norms(transformers.DeepseekV3ForCausalLM(config).eval())
    with torch.no_grad():  # a non-zero correction bias, so that choice and weights really differ
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_hf")
    dirs = {}
    for variant in VARIANTS:
        model = _hf_deepseek(variant)
        model.save_pretrained(root / variant)
        dirs[variant] = (root / variant, hf_logits(model, TOKENS))
    return dirs


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1, 1), (2, 2, 2, 1)], ids=["1dev", "ep4-fsdp-tp2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(hf_dirs, variant, mesh_shape):
    path, reference = hf_dirs[variant]
    model = loading.load_model(path, mesh_of(mesh_shape), RULES)
    assert (model.cfg.num_dense_layers, model.cfg.num_layers) == (1, 2)
    assert model.cfg.rope_scaling.kind is (RopeScaling.YARN if variant == "qlora_yarn" else RopeScaling.NONE)
    logits = compute_logits(model, TOKENS)
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


def test_hf_to_meshtrain_to_hf_is_bit_identical(hf_dirs, tmp_path):
    path, _ = hf_dirs["qlora_yarn"]
    mesh = mesh_of((1, 2, 2, 1))
    convert.from_hf(str(path), str(tmp_path / "mt"), mesh, RULES)
    convert.to_hf(str(tmp_path / "mt"), str(tmp_path / "hf"), mesh, RULES)
    original, again = hf.SafetensorsFiles(path), hf.SafetensorsFiles(tmp_path / "hf")
    assert sorted(original.file_of) == sorted(again.file_of)
    for name in original.file_of:
        full = (slice(None),) * len(original.shape(name))
        np.testing.assert_array_equal(again.read(name, full), original.read(name, full), err_msg=name)
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(reloaded.eval(), TOKENS), hf_dirs["qlora_yarn"][1], atol=1e-6, rtol=0)


@pytest.mark.slow  # the fast tier's HF round trip: tests/test_hf.py
def test_meshtrain_to_hf_to_meshtrain_maps_the_prediction_modules(tmp_path):
    """A model with two prediction depths and a plain query projection, written as HF files (the
    depths as layers 3 and 4, after the 3 decoder layers) and read back bit for bit; the copies of
    the embedding and head DeepSeek's checkpoints carry in each depth are accepted on import."""
    cfg = dataclasses.replace(DEEPSEEK, q_lora_rank=0, mtp_layers=2)
    params = nnx.state(_model(cfg, seed=3))
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), params)
    again = round_trip_through_hf(tmp_path, cfg, params, mesh_of((1, 2, 2, 1)))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"], config["q_lora_rank"]) == (3, 2, None)
    names = set(hf.SafetensorsFiles(tmp_path / "hf").file_of)
    assert {"model.layers.3.eh_proj.weight", "model.layers.4.shared_head.norm.weight",
            "model.layers.4.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate_proj.weight"} <= names
    assert not any(name.startswith("model.layers.5.") for name in names)
    # DeepSeek's layout also stores the embedding and the head in each prediction depth.
    from safetensors.numpy import load_file, save_file
    tensors = {name: value for file in (tmp_path / "hf").glob("*.safetensors")
               for name, value in load_file(file).items()}
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    single = tmp_path / "single"
    single.mkdir()
    save_file(tensors, str(single / hf.SINGLE_FILE), metadata={"format": "pt"})
    (single / "config.json").write_text(json.dumps(config))
    convert.from_hf(str(single), str(tmp_path / "mt3"), mesh_of((1, 1, 1, 1)), RULES)
    third = loading.load_model(tmp_path / "mt3", mesh_of((1, 1, 1, 1)), RULES)
    for (path, first), (_, loaded) in zip(nnx.to_flat_state(again.params), nnx.to_flat_state(third.params)):
        np.testing.assert_array_equal(np.asarray(loaded.get_value()), np.asarray(first.get_value()), err_msg=str(path))


@pytest.mark.parametrize("change, key", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"first_k_dense_replace": 3}, "first_k_dense_replace"),
    ({"n_group": 3}, "n_group"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.5, "rope_theta": 1e4}},
     "rope_parameters.attention_factor"),
])
def test_unsupported_checkpoints_are_refused_naming_the_key(hf_dirs, tmp_path, change, key):
    path, _ = hf_dirs["plain_query"]
    config = {**json.loads((path / "config.json").read_text()), **change}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        hf.model_config(hf.read_config(tmp_path / "hf"))
    assert key in str(err.value)


def test_generate_cli_gives_transformers_greedy_tokens(hf_dirs, tmp_path):
    """meshtrain.generate on the q-LoRA / YaRN checkpoint (the compressed cache; fsdp over 8 devices:
    one expert each) picks transformers' greedy tokens."""
    path, _ = hf_dirs["qlora_yarn"]
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    generate_cli_matches_transformers(path, reference, tmp_path, vocab=96, new_tokens=8)


@pytest.mark.slow
def test_finetune_from_hf_starts_at_the_transformers_loss(hf_dirs, tmp_path):
    """One step on (2,2,2,1) from the q-LoRA checkpoint (checkpoint.init_from=hf:DIR, the model
    section written out as overrides): the first logged loss is transformers' cross-entropy on the
    same batch (no auxiliary loss: the checkpoint's config has no aux_loss_alpha)."""
    path, _ = hf_dirs["qlora_yarn"]
    model = model_dict(dataclasses.replace(hf.model_config(hf.read_config(path)), seq_len=16))
    overrides = [f"model.{key}={json.dumps(value)}" for key, value in model.items()]
    cfg = load_config(None, [*overrides, "train.steps=1", "train.batch_size=8", "train.log_every=1",
                             "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "run.tensorboard=false",
                             f"run.dir={tmp_path}", "checkpoint.enabled=false", f"checkpoint.init_from=hf:{path}"])
    assert cfg.model.load_balancing_coef == 0 and cfg.model.mtp_layers == 0
    train(cfg, devices=jax.devices()[:8])
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager")
    first, expected = first_logged_and_transformers_loss(cfg, tmp_path, reference)
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow  # the fast tier's FLOP counts: tests/test_flops.py
def test_the_traced_step_counts_the_analytic_flops_plus_the_value_padding():
    """Matmul FLOPs of the traced train step (one row, one device; grouped matmuls at their rows,
    the dense ``xla`` attention and head that PaLM's formula describes) equal ``flops_per_token``
    exactly, dense layer, active experts, shared expert, router and the prediction depth included,
    plus the values' zero padding to the query/key width: 6 * T * heads * (qk - v) per token and
    layer (8.4% here, with v 16 < qk 24; none with v = qk)."""
    from meshtrain.measure.flops import count_flops
    from models.kernels.attention import AttentionKernel
    from models.deepseek import FAMILY
    from models.kernels.grouped_matmul import GroupedKernel

    base = DeepSeekConfig(vocab_size=256, embed_dim=64, num_layers=2, num_dense_layers=1, num_heads=4, q_lora_rank=32,
                          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mlp_dim=128,
                          num_experts=16, top_k=4, expert_mlp_dim=32, expert_groups=4, groups_per_token=2,
                          seq_len=256, mtp_layers=1, grouped_matmul=GroupedKernel.RAGGED,
                          attention=AttentionKernel.XLA)
    for cfg in (base, dataclasses.replace(base, v_head_dim=24)):
        trainer = make_trainer((1, 1, 1, 1), cfg, batch_size=1, loss_chunk=0)
        count = count_flops(trainer.step, trainer.abstract_state(), trainer.abstract_batch())
        padding = 6 * cfg.seq_len * cfg.num_heads * (cfg.qk_head_dim - cfg.v_head_dim) * cfg.all_layers
        assert count.flops == (FAMILY.costs(cfg).flops_per_token() + padding) * cfg.seq_len


# --- config.json as transformers writes it -----------------------------------------------------------

@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory):
    """(directory, logits) of a plain-query model saved by transformers with its config's default of
    one multi-token prediction module, which ``save_pretrained`` does not write."""
    path = tmp_path_factory.mktemp("deepseek_saved") / "hf"
    model = _hf_deepseek("plain_query", shape={k: v for k, v in HF_SHAPE.items() if k != "num_mtp_layers"})
    model.save_pretrained(path)
    return path, hf_logits(model, TOKENS)


def test_a_checkpoint_saved_by_transformers_imports_without_its_unwritten_prediction_module(
        saved_by_transformers, tmp_path, capsys):
    """convert from-hf (and checkpoint.init_from=hf:DIR's config) read it without prediction
    depths, say so in one stderr line, and give transformers' logits."""
    path, reference = saved_by_transformers
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(name.startswith("model.layers.3.") for name in hf.SafetensorsFiles(path).file_of)
    assert convert.main(["from-hf", "--hf", str(path), "--out", str(tmp_path / "mt")]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "num_nextn_predict_layers" in line]
    assert len(notes) == 1 and notes[0].startswith(f"warning: {path}: ") and "model.mtp_layers: 0" in notes[0]
    model = loading.load_model(tmp_path / "mt", mesh_of((1, 1, 1, 1)), RULES)
    assert model.cfg.mtp_layers == 0
    np.testing.assert_allclose(compute_logits(model, TOKENS), reference, atol=1e-4, rtol=0)
    assert hf.model_config(hf.read_config(path)).mtp_layers == 0


def test_a_partial_prediction_module_is_refused_naming_a_missing_tensor(saved_by_transformers, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _ = saved_by_transformers
    tensors = load_file(path / hf.SINGLE_FILE)
    tensors["model.layers.3.enorm.weight"] = np.ones(40, np.float32)
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / hf.SINGLE_FILE), metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"tensor model\.layers\.3\.\S+ is missing") as err:
        loading.load_model(tmp_path / "hf", mesh_of((1, 1, 1, 1)), RULES)
    assert "enorm" not in err.value.message


def _config_json(**changes) -> dict:
    """A plain-query ``deepseek_v3`` config.json (every routing key written) with ``changes``."""
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **HF_SHAPE,
            **VARIANTS["plain_query"], **changes}


@pytest.mark.parametrize("change, key, valid", [
    ({"topk_group": 0}, "topk_group", "between 1 and n_group=1"),  # was read as 1
    ({"n_group": 0}, "n_group", ">= 1"),  # was read as 1
    ({"n_group": 4, "topk_group": 2, "routed_scaling_factor": "x"}, "routed_scaling_factor", "finite number > 0"),
    ({"n_group": 4, "topk_group": 5}, "topk_group", "between 1 and n_group=4"),
    ({"n_group": None}, "n_group", ">= 1"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor", "finite number > 0"),
], ids=["topk_group_0", "n_group_0", "scaling_factor_text", "topk_group_above_n_group", "n_group_null",
        "scaling_factor_0"])
def test_routing_values_are_read_as_written_and_refused_naming_the_key(tmp_path, capsys, change, key, valid):
    """convert from-hf exits 2 with one line naming the config.json key and what would be valid."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(_config_json(**change)))
    rc = convert.main(["from-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mt")])
    one_line_error(rc, capsys.readouterr().err, f"config.json:{key}", valid)


def test_absent_routing_keys_take_transformers_defaults():
    """n_group, topk_group, routed_scaling_factor and norm_topk_prob left out read as transformers'
    DeepseekV3Config reads them."""
    keys = ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")
    written = {key: value for key, value in _config_json(n_routed_experts=16).items() if key not in keys}
    cfg = hf.model_config(written)
    defaults = transformers.DeepseekV3Config()
    assert (cfg.expert_groups, cfg.groups_per_token, cfg.routed_scaling_factor, cfg.norm_topk_prob) == tuple(
        getattr(defaults, key) for key in keys)
