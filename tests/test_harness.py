"""lm-evaluation-harness on meshtrain (``meshtrain.harness``, ``python -m meshtrain.evaluate``, the
``eval.harness`` entry of a run): a tiny Llama exported to HF files scores the same through
meshtrain's LM on a (2,2,2,1) mesh as through lm-eval's transformers backend (HFLM, torch CPU,
float32) on the three local YAML tasks of tests/harness_tasks (multiple choice, greedy generation,
rolling log-likelihood): equal accuracies and generations, log-likelihoods equal to 1e-5.

lm_eval, transformers, torch and accelerate are test extras (``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is not installed (a test extra: pip install -e '.[dev]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")
pytest.importorskip("torch", reason="torch is not installed (a test extra: pip install -e '.[dev]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (a test extra: pip install -e '.[dev]')")

from meshtrain import convert, evaluate, harness
from meshtrain.weights import loading
from meshtrain.weights.export_format import save_params
from meshtrain.config import model_dict
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.parallel.rules import Preset
from models.llama import Llama, LlamaConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "tests" / "harness_tasks"
TASKS = ["meshtrain_tiny_choice", "meshtrain_tiny_continue", "meshtrain_tiny_text"]
RULES = Preset.FSDP_TP.rules
# Distinct sizes (embed 40 != heads * head_dim 48); 32 positions, so the longest texts of
# tiny_text.jsonl take several rolling windows and the longest prompt of tiny_continue.jsonl is cut.
CFG = LlamaConfig(vocab_size=96, embed_dim=40, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=6,
                  mlp_dim=72, seq_len=32, rope_theta=10000.0, norm_eps=1e-6)
WORDS = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(CFG.vocab_size - 3)]


def write_tokenizer(directory: pathlib.Path) -> None:
    """A word-level ``tokenizer.json`` of ``WORDS`` (split at whitespace; <s> and </s> special) and the
    ``tokenizer_config.json`` transformers reads it with."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in WORDS[:3]])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "clean_up_tokenization_spaces": False}))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """(a meshtrain export of a random tiny Llama with its tokenizer, the same written by ``to-hf``)."""
    root = tmp_path_factory.mktemp("harness")
    params = nnx.state(Llama(CFG, rngs=nnx.Rngs(5)), nnx.Param)
    # Larger weights than the init's, so that the choices' log-likelihoods differ clearly.
    params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(2), x.shape), params)
    written = save_params(root / "mt", params, {"model": model_dict(CFG)})
    write_tokenizer(written)
    convert.to_hf(str(written), str(root / "hf"), make_mesh(MeshConfig()), RULES)
    return written, root / "hf"


@pytest.fixture(scope="module")
def both_results(model_dirs):
    """lm-eval's results (with samples) for TASKS through meshtrain's LM and through HFLM."""
    export, hf_dir = model_dirs
    manager = harness.task_manager(str(TASKS_DIR), field="--include-path")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
        model = loading.load_model(export, make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), RULES)
        lm = harness.MeshtrainLM(model.graphdef, model.params, model.mesh, model.rules,
                                 harness.TextTokenizer(export / "tokenizer.json", field="--model"),
                                 max_length=CFG.seq_len, batch_size=3)
        ours = harness.evaluate_tasks(lm, TASKS, manager, log_samples=True, bootstrap_iters=0)
        from lm_eval.models.huggingface import HFLM

        reference = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=3)
        theirs = harness.evaluate_tasks(reference, TASKS, manager, log_samples=True, bootstrap_iters=0)
    return ours, theirs


def _responses(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_multiple_choice_equals_transformers(both_results):
    ours, theirs = both_results
    mine, reference = _responses(ours, TASKS[0]), _responses(theirs, TASKS[0])
    assert len(mine) == 8 and sum(len(r) for r in mine) == 23  # 8 questions, 23 choices
    for doc, ref_doc in zip(mine, reference):
        np.testing.assert_allclose([float(r[0][0]) for r in doc], [float(r[0][0]) for r in ref_doc], atol=1e-5, rtol=0)
        assert [bool(r[0][1]) for r in doc] == [bool(r[0][1]) for r in ref_doc]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][TASKS[0]][metric] == theirs["results"][TASKS[0]][metric]
    assert 0 < ours["results"][TASKS[0]]["acc,none"] < 1  # the model prefers some answers, not all


def test_generation_equals_transformers(both_results):
    ours, theirs = both_results
    mine, reference = _responses(ours, TASKS[1]), _responses(theirs, TASKS[1])
    assert mine == reference and len(mine) == 6
    assert all(r[0] for r in mine)  # every prompt continued by some text
    assert ours["results"][TASKS[1]]["exact_match,none"] == theirs["results"][TASKS[1]]["exact_match,none"]


def test_rolling_loglikelihood_equals_transformers(both_results):
    ours, theirs = both_results
    mine, reference = _responses(ours, TASKS[2]), _responses(theirs, TASKS[2])
    # Sums over up to 140 tokens (fp32 sums of 100s of nats: rtol 2e-7 is a few units of their last place).
    np.testing.assert_allclose([float(r[0][0]) for r in mine], [float(r[0][0]) for r in reference], atol=1e-5,
                               rtol=2e-7)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        np.testing.assert_allclose(ours["results"][TASKS[2]][metric], theirs["results"][TASKS[2]][metric],
                                   rtol=1e-6)



@pytest.mark.slow  # the fast tier's harness: the transformers equalities above
def test_evaluate_cli_prints_the_table_and_writes_the_results(model_dirs, both_results, tmp_path, monkeypatch):
    """``--model EXPORT`` on the default mesh (fsdp over 8 devices): the scores of the in-process LM."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "results.json"
    printed = []
    assert evaluate.main(["--model", str(model_dirs[0]), "--tasks", ",".join(TASKS[:2]), "--include-path",
                          str(TASKS_DIR), "--limit", "5", "--batch-size", "2", "--out", str(out)],
                         print_fn=printed.append) == 0
    written = json.loads(out.read_text())
    ours = both_results[0]
    assert sorted(written["results"]) == TASKS[:2] and written["n-samples"][TASKS[0]]["effective"] == 5
    first = [float(np.mean([s["acc"] for s in ours["samples"][TASKS[0]] if s["doc_id"] < 5]))]
    assert [written["results"][TASKS[0]]["acc,none"]] == first
    assert TASKS[0] in printed[0] and "acc" in printed[0]


@pytest.mark.parametrize("argv, field, hint", [
    (["--tasks", "meshtrain_tiny_choice", "--limit", "0"], "--limit", "a whole number"),
    (["--tasks", "meshtrain_tiny_choice", "--limit", "2.5"], "--limit", "a whole number"),
    (["--tasks", "meshtrain_tiny_choice", "--batch-size", "0"], "--batch-size", "positive integer"),
    (["--tasks", "meshtrain_tiny_choice", "--out", "results.txt"], "--out", "not a .json path"),
    (["--tasks", "meshtrain_tiny_choice", "--step", "3"], "--step", "applies to --run only"),
    (["--tasks", "no_such_task_52"], "--tasks", "unknown task(s) ['no_such_task_52']"),
    (["--tasks", "meshtrain_tiny_choice", "--include-path", "no/such/dir"], "--include-path", "no such directory"),
])
def test_evaluate_cli_errors_are_one_line(model_dirs, capsys, argv, field, hint):
    include = [] if "--include-path" in argv else ["--include-path", str(TASKS_DIR)]
    assert evaluate.main(["--model", str(model_dirs[0]), *include, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: ") and hint in err[0], err


def test_run_flag_refuses_an_export(model_dirs, capsys):
    assert evaluate.main(["--run", str(model_dirs[0]), "--tasks", "meshtrain_tiny_choice"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --run: {model_dirs[0]} is an export or HF directory; use --model"


@pytest.mark.slow  # the fast tier's harness: the transformers equalities above
def test_harness_scores_during_training_go_to_metrics_jsonl(model_dirs, tmp_path, monkeypatch, capsys):
    """eval.every=2 and eval.harness.every=3 over 4 steps: held-out metrics at 2 and 4, lm-eval's scores
    at 3 and 4 (the last step), the last equal to ``meshtrain.evaluate --run`` on the final checkpoint."""
    from meshtrain.train import main as train

    monkeypatch.chdir(ROOT)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(3, CFG.vocab_size, 20_000).astype(np.uint16))
    run_dir = tmp_path / "run"
    assert train(["--config", str(ROOT / "configs" / "tiny.yaml"), "model.vocab_size=96", "model.embed_dim=32",
                  "model.seq_len=32", "train.batch_size=8", "train.steps=4", "train.log_every=1",
                  "checkpoint.async_save=false", "data.source=tokens", f"data.path={ids}",
                  f"data.tokenizer={model_dirs[0] / 'tokenizer.json'}", f"eval.path={ids}", "eval.every=2",
                  "eval.batches=1", "eval.harness.tasks=[meshtrain_tiny_choice]",
                  f"eval.harness.include_path={TASKS_DIR}", "eval.harness.every=3", "eval.harness.limit=6",
                  f"run.dir={run_dir}"]) == 0
    assert "lm-eval tasks meshtrain_tiny_choice every 3 steps" in capsys.readouterr().err
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    held_out = [line["step"] for line in lines if "eval_loss" in line]
    scored = {line["step"]: line for line in lines if "harness/meshtrain_tiny_choice/acc" in line}
    assert held_out == [2, 4] and sorted(scored) == [3, 4]
    assert set(scored[3]) == {"step", "harness/meshtrain_tiny_choice/acc", "harness/meshtrain_tiny_choice/acc_norm"}
    out = tmp_path / "final.json"
    assert evaluate.main(["--run", str(run_dir), "--tasks", "meshtrain_tiny_choice", "--include-path", str(TASKS_DIR),
                          "--limit", "6", "--out", str(out)], print_fn=lambda _: None) == 0
    final = json.loads(out.read_text())["results"]["meshtrain_tiny_choice"]
    assert scored[4]["harness/meshtrain_tiny_choice/acc"] == final["acc,none"]
    assert scored[4]["harness/meshtrain_tiny_choice/acc_norm"] == final["acc_norm,none"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["harness/meshtrain_tiny_choice/acc"] == final["acc,none"]


@pytest.mark.parametrize("overrides, field, hint", [
    (["eval.harness.tasks=[meshtrain_tiny_choice]"], "eval.harness", "eval.every > 0"),
    (["eval.harness.tasks=meshtrain_tiny_choice"], "eval.harness.tasks", "got the string"),
    (["eval.every=2", "eval.harness.tasks=[a]", "eval.harness.batch_size=0"], "eval.harness.batch_size", ">= 1"),
    (["eval.every=2", "eval.harness.tasks=[meshtrain_tiny_choice]"], "eval.harness", "needs a tokenizer.json"),
])
def test_bad_harness_settings_are_one_line_errors(tmp_path, capsys, overrides, field, hint):
    """Found before anything is compiled (the markov source has no tokenizer for the tasks' text)."""
    from meshtrain.train import main as train

    assert train(["--config", str(ROOT / "configs" / "tiny.yaml"), *overrides, f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: ") and hint in err[0], err


def test_to_hf_names_the_end_of_text_token_of_a_runs_own_tokenizer(model_dirs, tmp_path):
    """A tokenizer.json without a tokenizer_config.json (a run's own, from train-tokenizer) gets one naming
    the token prepare ends documents with, which transformers then reads as eos; one of its own is kept."""
    import shutil

    from transformers import AutoTokenizer

    export = tmp_path / "export"
    shutil.copytree(model_dirs[0], export)
    (export / "tokenizer_config.json").unlink()
    written = convert.to_hf(str(export), str(tmp_path / "hf"), make_mesh(MeshConfig()), RULES)
    assert "tokenizer_config.json" in written
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token_id == WORDS.index("</s>")
    assert json.loads((model_dirs[1] / "tokenizer_config.json").read_text()) == json.loads(
        (model_dirs[0] / "tokenizer_config.json").read_text())  # copied as it was
