"""A real corpus end to end: train-tokenizer -> prepare -> train with evaluation -> generate, and the
data options around it (mixtures, tokenizer checks, held-out data), against independent references:
``meshtrain.logits`` for the eval loss (rel 1e-5), counts for the mixture (1%)."""

import json
import math

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from meshtrain import generate, logits
from meshtrain.config import load_config
from meshtrain.data import DataConfig, DataSource, MixtureEntry, Packing, global_batch, make_dataset
from meshtrain.data.__main__ import main as data_main
from meshtrain.data.prepared import PreparedCorpus
from meshtrain.errors import ConfigError
from meshtrain.train import main as train_main

WORDS = ["the", "a", "mesh", "device", "shard", "gradient", "layer", "token", "model", "batch", "loss", "step",
         "data", "pipeline", "stage", "attention", "vocabulary", "parameter", "optimizer", "window", "document"]
MODEL = ["model.vocab_size=384", "model.embed_dim=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.seq_len=32"]


def _write_corpus(directory, seed: int, documents: int = 60):
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    for i in range(documents):
        sentences = [" ".join(rng.choice(WORDS, rng.integers(4, 12))).capitalize() + "."
                     for _ in range(rng.integers(2, 8))]
        (directory / f"doc{i:03d}.txt").write_text(" ".join(sentences) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(tokenizer dir, prepared dir with a val split, a second prepared dir, raw text dir)."""
    root = tmp_path_factory.mktemp("corpus")
    _write_corpus(root / "text", seed=0)
    _write_corpus(root / "other_text", seed=1, documents=30)
    assert data_main(["train-tokenizer", "--input", str(root / "text" / "*.txt"), "--vocab-size", "320",
                      "--out", str(root / "tok")]) == 0
    for text, out, extra in (("text", "prepared", ["--val-fraction", "0.25"]), ("other_text", "other", [])):
        assert data_main(["prepare", "--tokenizer", str(root / "tok"), "--input", str(root / text / "*.txt"),
                          "--out", str(root / out), "--no-progress", *extra]) == 0
    return root / "tok", root / "prepared", root / "other", root / "text"


def test_prepare_train_evaluate_generate(corpus, tmp_path, capsys):
    tok, prepared, _, _ = corpus
    run = tmp_path / "run"
    argv = ["train.steps=6", "train.batch_size=8", "train.log_every=3", "eval.every=3", "eval.batches=2",
            "data.source=tokens", f"data.path={prepared}", f"run.dir={run}", "train.precision=fp32",
            "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *MODEL]
    assert train_main(argv) == 0
    assert (run / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_loss"] == evals[-1]["eval_loss"]
    assert math.isclose(summary["eval_perplexity"], math.exp(summary["eval_loss"]), rel_tol=1e-9)

    # The eval loss equals the loss of meshtrain.logits' logits on the same held-out windows.
    split = PreparedCorpus.open(str(prepared)).split("val")
    windows = np.stack([split.tokens(w * 33, (w + 1) * 33) for w in range(2 * 8)]).astype(np.int64)
    np.save(tmp_path / "windows.npy", windows[:, :-1])
    assert logits.main(["--model", str(run), "--tokens", str(tmp_path / "windows.npy"),
                        "--out", str(tmp_path / "logits.npy")]) == 0
    log_probs = jax.nn.log_softmax(np.load(tmp_path / "logits.npy").astype(np.float64), -1)
    expected = -np.take_along_axis(np.asarray(log_probs), windows[:, 1:, None], -1).mean()
    assert summary["eval_loss"] == pytest.approx(expected, rel=1e-5)
    per_byte = split.text_bytes / split.num_tokens
    assert summary["eval_bits_per_byte"] == pytest.approx(summary["eval_loss"] / math.log(2) / per_byte, rel=1e-9)

    # generate --tokenizer auto finds the run's tokenizer (not bytes).
    printed = []
    capsys.readouterr()
    assert generate.main(["--run", str(run), "--prompt", "The mesh", "--max-new-tokens", "5"],
                         print_fn=printed.append) == 0
    assert printed[0].startswith("The mesh")
    from meshtrain.weights import loading
    from meshtrain.mesh import MeshConfig, make_mesh
    model = loading.load_model(run, make_mesh(MeshConfig()), load_config(None).sharding.resolve(), field="--run")
    chosen = generate.make_tokenizer("auto", model)
    assert isinstance(chosen, generate.HFTokenizer) and chosen.path == run / "tokenizer.json"
    assert chosen.eos_id == PreparedCorpus.open(str(prepared)).tokenizer.eos_id
    assert chosen.encode("The mesh") != list(b"The mesh")


@pytest.mark.slow
def test_generate_refuses_bytes_for_a_model_trained_on_tokens(corpus, tmp_path, capsys):
    _, prepared, _, _ = corpus
    run = tmp_path / "run"
    assert train_main(["train.steps=1", "train.batch_size=8", "data.source=tokens", f"data.path={prepared}",
                       f"run.dir={run}", *MODEL]) == 0
    (run / "tokenizer.json").unlink()  # a run from before tokenizers were recorded
    capsys.readouterr()
    assert generate.main(["--run", str(run), "--prompt", "The mesh"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --tokenizer:") and "not trained on bytes" in err and len(err.splitlines()) == 1


def test_mixture_proportions_and_determinism(corpus):
    _, prepared, other, _ = corpus
    cfg = DataConfig(source=DataSource.TOKENS, mixture=(MixtureEntry(str(prepared), 0.7),
                                                        MixtureEntry(str(other), 0.3)))
    dataset = make_dataset(cfg, vocab_size=384, seq_len=16)
    picks = dataset.sources(np.arange(1000 * 8))
    share = np.bincount(picks[:, 0], minlength=2) / picks.shape[0]
    np.testing.assert_allclose(share, [0.7, 0.3], atol=0.01)
    # Same batches whatever the mesh, and whatever rows a process builds (any split of a batch).
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",), axis_types=(AxisType.Auto,)), P("data"))
    eight = NamedSharding(Mesh(np.array(jax.devices()), ("data",), axis_types=(AxisType.Auto,)), P("data"))
    for step in (0, 7):
        a, b = global_batch(dataset, step, 16, one), global_batch(dataset, step, 16, eight)
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
    whole = dataset.rows(np.arange(32, 48))
    halves = [dataset.rows(np.arange(32, 40)), dataset.rows(np.arange(40, 48))]
    for key in whole:
        np.testing.assert_array_equal(whole[key], np.concatenate([h[key] for h in halves]))
    again = make_dataset(cfg, vocab_size=384, seq_len=16).rows(np.arange(32, 48))
    np.testing.assert_array_equal(again["inputs"], whole["inputs"])


def test_one_line_errors_for_bad_corpus_input(corpus, tmp_path):
    _, prepared, _, text = corpus

    def field_of(cfg, vocab_size=384):
        with pytest.raises(ConfigError) as info:
            make_dataset(cfg, vocab_size=vocab_size, seq_len=16)
        return info.value.field, info.value.message

    tokens = DataSource.TOKENS
    assert field_of(DataConfig(source=tokens, path=str(prepared)), vocab_size=100)[0] == "model.vocab_size"
    assert data_main(["train-tokenizer", "--input", str(text / "*.txt"), "--vocab-size", "300",
                      "--out", str(tmp_path / "tok2")]) == 0
    field, message = field_of(DataConfig(source=tokens, path=str(prepared), tokenizer=str(tmp_path / "tok2")))
    assert field == "data.tokenizer" and "another tokenizer" in message
    assert field_of(DataConfig(source=tokens, path=str(text)))[0] == "data.path"  # not a prepared dir
    missing_tokenizer = DataConfig(source=tokens, path=str(prepared), tokenizer=str(tmp_path / "nope"))
    assert field_of(missing_tokenizer)[0] == "data.tokenizer"
    np.save(tmp_path / "ids.npy", np.arange(100))
    assert field_of(DataConfig(source=tokens, path=str(tmp_path / "ids.npy"), packing=Packing.DOCUMENTS))[0] \
        == "data.packing"
    for overrides, field in [
        (["data.source=tokens", "data.mixture=[{path: a, weight: 0}]"], "data.mixture[0].weight"),
        (["data.source=tokens", "data.mixture=[{path: a, weight: -1}]"], "data.mixture[0].weight"),
        (["data.source=tokens", "data.mixture=[{path: a, wieght: 1}]"], "data.mixture[0].wieght"),
        (["data.packing=documents"], "data.packing"),
        (["eval.every=-1"], "eval.every"),
        (["eval.batches=0"], "eval.batches")]:
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert info.value.field == field, overrides


@pytest.mark.slow
def test_evaluation_needs_held_out_data(corpus, tmp_path, capsys):
    _, _, other, _ = corpus
    argv = ["train.steps=1", "train.batch_size=8", "data.source=tokens", f"data.path={other}", "eval.every=1",
            f"run.dir={tmp_path / 'run'}", *MODEL]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.path:") and "no 'val' split" in err
    # Another prepared directory's train split serves as held-out data.
    assert train_main([*argv, f"eval.path={other}", "eval.split=train", "checkpoint.enabled=false"]) == 0
