"""Samples during training (``eval.sample_prompts``; issue 39 item 5): at each evaluation every
prompt is continued by the model with the run's tokenizer, written to ``metrics.jsonl``, the
console and the trackers (TensorBoard text, an MLflow artifact read back with ``MlflowClient``);
the last samples equal ``meshtrain.generate``'s continuation of the run's final checkpoint; and the
one-line errors."""

from __future__ import annotations

import json
import pathlib

import pytest

from meshtrain import generate
from meshtrain.config import load_config
from meshtrain.errors import ConfigError
from meshtrain.train import main

REPO = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = ["def ", "the "]
# Bytes as tokens (data.source=text): a vocabulary of 256; a few steps, evaluation and samples at 2 and 4.
RUN = ["model.vocab_size=256", "model.embed_dim=32", "model.seq_len=32", "train.batch_size=8", "train.steps=4",
       "train.log_every=1", "eval.every=2", "eval.batches=1", f"eval.sample_prompts={json.dumps(PROMPTS)}",
       "eval.sample_tokens=8", "checkpoint.async_save=false", "data.source=text"]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples")
    corpus = root / "corpus.txt"
    corpus.write_text("def the function returns the value of the thing.\n" * 400)
    run_dir = root / "run"
    pytest.importorskip("mlflow")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", (root / "mlruns").as_uri())
        patch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        assert main(["--config", str(REPO / "configs" / "tiny.yaml"), *RUN, f"data.path={corpus}",
                     f"eval.path={corpus}", f"run.dir={run_dir}", "run.loggers=[tensorboard, mlflow]"]) == 0
        from mlflow import MlflowClient

        client = MlflowClient()
        run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
        artifacts = {step: pathlib.Path(client.download_artifacts(run_id, f"samples/step_{step:08d}.md",
                                                                  str(root / f"artifacts{step}"))).read_text()
                     for step in (2, 4)}
    return run_dir, artifacts


@pytest.mark.slow  # the fast tier's generation: tests/test_corpus_run.py
def test_samples_are_written_at_each_evaluation_and_match_generate(text_run, capsys):
    run_dir, artifacts = text_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = {line["step"]: line["samples"] for line in lines if "samples" in line}
    assert sorted(samples) == [2, 4]
    for step, entries in samples.items():
        assert [entry["prompt"] for entry in entries] == PROMPTS
        assert all(isinstance(entry["text"], str) and len(entry["text"].encode()) <= 8 * 4 for entry in entries)
        # The MLflow artifact of that evaluation holds each prompt and its continuation.
        assert artifacts[step] == "\n\n".join(f"**{e['prompt']}**{e['text']}" for e in entries)
    # The final samples are what meshtrain.generate continues the final checkpoint with (greedy).
    for entry in samples[4]:
        printed = []
        assert generate.main(["--run", str(run_dir), "--prompt", entry["prompt"], "--max-new-tokens", "8"],
                             print_fn=printed.append) == 0
        assert printed == [entry["prompt"] + entry["text"]]


@pytest.mark.parametrize("overrides, field, hint", [
    (["eval.every=2", "eval.sample_prompts=[hello]"], "eval.sample_prompts", "data.source=markov"),
    (["eval.sample_prompts=[hello]"], "eval.sample_prompts", "eval.every > 0"),
    (["eval.every=2", "eval.sample_prompts=[hello]", "eval.sample_temperature=-1"], "eval.sample_temperature",
     "finite number >= 0"),
    (["eval.every=2", "eval.sample_prompts=['']"], "eval.sample_prompts", "non-empty strings"),
    (["eval.every=2", "eval.sample_prompts=[hi]", "eval.sample_tokens=0"], "eval.sample_tokens", ">= 1"),
])
def test_bad_sample_settings_are_one_line_errors(tmp_path, capsys, overrides, field, hint):
    """Found before anything is compiled: the markov source has no tokenizer for the prompts."""
    assert main(["--config", str(REPO / "configs" / "tiny.yaml"), *overrides, f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: ") and hint in err[0], err


def test_sample_prompts_load_as_a_tuple_of_strings():
    cfg = load_config(None, ["eval.every=5", 'eval.sample_prompts=["a b", "c"]'])
    assert cfg.eval.sample_prompts == ("a b", "c")
    with pytest.raises(ConfigError):
        load_config(None, ["eval.every=5", "eval.sample_prompts=hello"])


def test_a_sample_kv_cache_beyond_the_device_memory_stops_before_the_first_step(tmp_path, capsys):
    """Issue 53, item 12: checked at start-up from the prefill's abstract shapes, not at the first
    evaluation after training steps."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def the function returns the value of the thing.\n" * 40)
    run_dir = tmp_path / "run"
    assert main(["--config", str(REPO / "configs" / "tiny.yaml"), *RUN, f"data.path={corpus}", f"eval.path={corpus}",
                 f"run.dir={run_dir}", "run.loggers=[]", "eval.sample_tokens=1000000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: eval.sample_tokens: a KV cache of 1,000,000,004 positions "), err
    assert "ask for fewer new tokens" in err[0] and not (run_dir / "metrics.jsonl").exists()
