"""transformers as the reference of the Hugging Face tests: tiny random Llama and Mistral models (norm
scales random, not ones), their logits, checkpoints saved by transformers, and the checks the HF test
modules share. Importing it skips the importing test module where transformers or torch is missing
(test extras: ``pip install -e '.[dev]'``)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from flax import nnx

from meshtrain import convert, generate
from meshtrain.config import model_dict
from meshtrain.data import make_dataset
from meshtrain.parallel.rules import Preset
from meshtrain.weights import hf, loading
from meshtrain.weights.export_format import save_params

transformers = pytest.importorskip("transformers", reason="transformers is not installed (a test extra: "
                                   "pip install -e '.[dev]')")
torch = pytest.importorskip("torch", reason="torch is not installed (a test extra: pip install -e '.[dev]')")

RULES = Preset.FSDP_TP.rules
TOKENS = np.random.default_rng(0).integers(0, 128, (3, 24))  # 3 rows: padded on a 2-way batch split
# Tiny shapes with GQA (4 query heads share 2 key/value heads).
HF_SHAPE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "initializer_range": 0.1}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # scales at these lengths
VARIANTS = {
    "gqa": {"tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
    "tied_llama3": {"tie_word_embeddings": True, "rope_parameters": LLAMA3},
    # Mistral with a sliding window of 5 positions, shorter than the 24-token rows.
    "mistral_window": {"tie_word_embeddings": False, "sliding_window": 5},
}


def llama_model(variant: str, seed: int = 0):
    """transformers' model of ``VARIANTS[variant]`` at ``HF_SHAPE``, random weights and norm scales, eval mode."""
    torch.manual_seed(seed)
    if variant == "mistral_window":
        config = transformers.MistralConfig(**HF_SHAPE, **VARIANTS[variant], attn_implementation="eager")
        return random_norms(transformers.MistralForCausalLM(config).eval())
    config = transformers.LlamaConfig(**HF_SHAPE, **VARIANTS[variant])
    return random_norms(transformers.LlamaForCausalLM(config).eval())


def random_norms(model):
    """``model`` with random norm scales: they are ones at init, which would hide their mapping."""
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """float32 logits [rows, length, vocab] of transformers' ``model`` on ``tokens``."""
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def hf_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files of an HF directory, by name."""
    files = hf.SafetensorsFiles(path)
    return {name: files.read(name, ()) for name in files.file_of}


def generate_cli_matches_transformers(path: pathlib.Path, reference, tmp_path: pathlib.Path, vocab: int,
                                      new_tokens: int) -> None:
    """``meshtrain.generate --hf path`` with a word-level tokenizer (``w0`` .. ``w{vocab-3}`` after
    ``<unk>`` and ``</s>``) continues ``w3 w7 w9`` with the greedy tokens of transformers' ``reference``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(vocab - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    printed = []
    argv = ["--hf", str(path), "--prompt", "w3 w7 w9", "--max-new-tokens", str(new_tokens),
            "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert generate.main(argv, print_fn=printed.append) == 0
    with torch.no_grad():
        ids = reference.generate(torch.tensor([[5, 9, 11]]), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)[0, 3:].tolist()
    assert printed == ["w3 w7 w9" + tokenizer.decode(ids)]


def save_variants(root: pathlib.Path, build, variants, tokens: np.ndarray, *, sharded: str, bf16: str) -> dict:
    """{variant: (directory, logits of ``tokens``)} for each ``build(variant)`` saved by transformers under
    ``root`` (``sharded`` in 40 KB files), and ``"bf16"``: a bfloat16 copy of ``bf16`` (no logits)."""
    dirs = {}
    for variant in variants:
        model = build(variant)
        model.save_pretrained(root / variant, max_shard_size="40KB" if variant == sharded else "5GB")
        dirs[variant] = (root / variant, hf_logits(model, tokens))
    build(bf16).to(torch.bfloat16).save_pretrained(root / f"{bf16}_bf16")
    dirs["bf16"] = (root / f"{bf16}_bf16", None)
    assert (dirs[sharded][0] / hf.INDEX_FILE).is_file()  # the sharded layout is exercised
    return dirs


def round_trip_through_hf(tmp_path: pathlib.Path, cfg, params: nnx.State, mesh) -> loading.LoadedModel:
    """``params`` of ``cfg`` exported as ``tmp_path/mt``, written as HF files to ``tmp_path/hf`` (sharded),
    imported again and loaded on ``mesh``; checked equal to ``params``, bit for bit."""
    save_params(tmp_path / "mt", params, {"model": model_dict(cfg)})
    files = convert.to_hf(str(tmp_path / "mt"), str(tmp_path / "hf"), mesh, RULES, max_shard_bytes=30_000)
    assert hf.INDEX_FILE in files
    convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "mt2"), mesh, RULES)
    again = loading.load_model(tmp_path / "mt2", mesh, RULES)
    assert again.cfg == cfg
    for (path, original), (_, loaded) in zip(nnx.to_flat_state(params), nnx.to_flat_state(again.params)):
        np.testing.assert_array_equal(np.asarray(loaded.get_value()), np.asarray(original.get_value()),
                                      err_msg=str(path))
    return again


def first_logged_and_transformers_loss(cfg, run_dir, model) -> tuple[dict, float]:
    """The run's first logged metrics, and the fp32 cross-entropy of transformers' ``model`` on the
    run's first batch."""
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    vocab = cfg.model.vocab_size
    batch = make_dataset(cfg.data, vocab_size=vocab, seq_len=cfg.model.seq_len).rows(np.arange(cfg.train.batch_size))
    logits = torch.tensor(hf_logits(model.eval(), batch["inputs"]))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                 torch.tensor(batch["targets"]).reshape(-1).long()).item()
    return first, expected
