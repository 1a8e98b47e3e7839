"""What a new user gets wrong on day one, each answered in one line.

The errors exit 2 with one ``error: field: ...`` line that names the field, says what happened and
what would be valid. Checked: a data path that does not exist, a field of another model family, a
mesh beyond the devices, a Hugging Face directory given without ``hf:``, and a changed config on a
run directory that already holds checkpoints. Also checked: a plugin family under ``tests/`` loads
without ``PYTHONPATH``, ``train-tokenizer`` says when it trained fewer tokens than asked, and
``bench_pipeline.py`` writes its plot outside the tracked docs by default.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from tokenizers import Tokenizer

from meshtrain.config import load_config, to_dict
from meshtrain.data.__main__ import main as data_main
from meshtrain.loop import train
from meshtrain.train import main
from utils import one_line_error

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
TOY = REPO / "tests" / "toy_gpt.yaml"
TOY_FILE = REPO / "tests" / "toy_family.py"
SMALL = ["model.embed_dim=32", "train.batch_size=16", "train.log_every=1", "run.tensorboard=false"]


# --- a data path that does not exist ---------------------------------------------------------------

@pytest.mark.parametrize("packing", ["documents", "concat"])
def test_a_mistyped_prepared_directory_is_no_such_path_with_a_close_spelling(tmp_path, capsys, no_compile,
                                                                             packing):
    (tmp_path / "prepared").mkdir()
    typo = tmp_path / "prepard"
    rc = main(["--config", TINY, *SMALL, f"run.dir={tmp_path / 'run'}", "data.source=tokens",
               f"data.path={typo}", f"data.packing={packing}", "model.vocab_size=256"])
    line = one_line_error(rc, capsys.readouterr().err, "data.path", f"no such file or directory: {typo}",
                          f"did you mean {tmp_path / 'prepared'}?",
                          "a prepared directory (python -m meshtrain.data prepare) or a .npy or .bin file")
    assert "single file of ids" not in line


def test_a_missing_mixture_entry_and_a_missing_text_path_name_their_field(tmp_path, capsys, no_compile):
    base = ["--config", TINY, *SMALL, f"run.dir={tmp_path / 'run'}", "model.vocab_size=256"]
    rc = main([*base, "data.source=tokens", "data.packing=documents",
               f"data.mixture=[{{path: {tmp_path / 'nowhere'}, weight: 1.0}}]"])
    one_line_error(rc, capsys.readouterr().err, "data.mixture[0].path", "no such file or directory",
                   ".npy or .bin file of token ids")
    rc = main([*base, "data.source=text", f"data.path={tmp_path / 'corpus.txt'}"])
    one_line_error(rc, capsys.readouterr().err, "data.path", f"no such file or directory: {tmp_path / 'corpus.txt'}",
                   "a text file, a directory of them or a quoted glob")
    rc = main([*base, "data.source=text", f"data.path={tmp_path}/*.md"])
    one_line_error(rc, capsys.readouterr().err, "data.path", f"no files match the glob {tmp_path}/*.md")
    (tmp_path / "empty").mkdir()
    rc = main([*base, "data.source=text", f"data.path={tmp_path / 'empty'}"])
    one_line_error(rc, capsys.readouterr().err, "data.path", f"the directory {tmp_path / 'empty'} holds no files")


def test_packing_documents_on_an_existing_single_file_still_says_what_it_needs(tmp_path, capsys, no_compile):
    ids = tmp_path / "ids.bin"
    ids.write_bytes(bytes(200))
    rc = main(["--config", TINY, *SMALL, f"run.dir={tmp_path / 'run'}", "data.source=tokens", f"data.path={ids}",
               "data.packing=documents", "data.token_dtype=uint8", "model.vocab_size=256"])
    one_line_error(rc, capsys.readouterr().err, "data.packing", "needs the document boundaries of a prepared "
                   f"directory (python -m meshtrain.data prepare); {ids} is a single file of ids")


# --- a field of another model family -----------------------------------------------------------------

def test_a_field_of_another_family_names_the_families_that_have_it(capsys):
    rc = main(["--config", TINY, "model.num_experts=8", "--print-config"])
    line = one_line_error(rc, capsys.readouterr().err, "model.num_experts",
                          "is not a field of model.family 'llama' (the default)",
                          "the families 'deepseek', 'moe' have it", "set model.family: deepseek or moe",
                          "fields of 'llama': ['vocab_size'")
    assert "did you mean" not in line and "num_layers'?" not in line
    rc = main(["--config", TINY, "model.family=llama", "model.kv_lora_rank=64", "--print-config"])
    one_line_error(rc, capsys.readouterr().err, "model.kv_lora_rank", "is not a field of model.family 'llama';",
                   "the family 'deepseek' has it: set model.family: deepseek to use it")


def test_a_misspelt_model_field_still_gets_its_close_spelling(capsys):
    rc = main(["--config", TINY, "model.num_layer=8", "--print-config"])
    one_line_error(rc, capsys.readouterr().err, "model.num_layer", "unknown field (did you mean 'num_layers'?)")


def test_the_field_is_accepted_under_the_family_it_names():
    cfg = load_config(None, ["model.family=moe", "model.num_experts=8"])
    assert cfg.model.num_experts == 8


# --- a mesh beyond the devices ------------------------------------------------------------------------

def test_a_mesh_beyond_the_devices_says_how_many_are_available():
    from meshtrain.errors import ConfigError
    from meshtrain.mesh import MeshConfig, make_mesh

    with pytest.raises(ConfigError, match="but 1 is available; make the product 1"):
        make_mesh(MeshConfig(data=2, fsdp=1), jax.devices()[:1])


# --- a Hugging Face directory without hf: ------------------------------------------------------------

@pytest.mark.parametrize("key", ["checkpoint.init_from", "model.init_from"])
def test_an_hf_directory_without_the_prefix_is_recognised(tmp_path, capsys, no_compile, key):
    hf_dir = tmp_path / "Llama-3.2-1B"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf_dir / "model.safetensors").write_bytes(b"")
    rc = main(["--config", TINY, *SMALL, f"run.dir={tmp_path / 'run'}", f"{key}={hf_dir}"])
    one_line_error(rc, capsys.readouterr().err, "checkpoint.init_from",
                   f"{hf_dir} is a Hugging Face checkpoint (config.json), not a meshtrain export",
                   f"write checkpoint.init_from=hf:{hf_dir} to import it")


def test_a_missing_init_from_says_so_and_names_both_kinds(tmp_path, capsys, no_compile):
    rc = main(["--config", TINY, *SMALL, f"run.dir={tmp_path / 'run'}", f"checkpoint.init_from={tmp_path / 'x'}"])
    one_line_error(rc, capsys.readouterr().err, "checkpoint.init_from", f"no such directory: {tmp_path / 'x'}",
                   "python -m meshtrain.export", "hf:DIR for a Hugging Face checkpoint")


# --- a changed config on a run directory with checkpoints ---------------------------------------------

def test_a_changed_learning_rate_resumes_with_one_clear_warning_or_is_refused_when_nothing_would_train(
        tmp_path, capsys):
    run_dir = tmp_path / "run"
    one_device = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    train(load_config(TINY, [*SMALL, *one_device, "train.steps=2", "checkpoint.every=2", f"run.dir={run_dir}"]),
          devices=jax.devices()[:1])
    capsys.readouterr()

    # Already at train.steps with another learning rate: nothing would train, so it is refused.
    rc = main(["--config", TINY, *SMALL, "train.steps=2", f"run.dir={run_dir}", "optimizer.learning_rate=1e-3"])
    one_line_error(rc, capsys.readouterr().err, "run.dir",
                   f"{run_dir} is already at train.steps=2 ({run_dir / 'checkpoints' / '2'})",
                   "optimizer.learning_rate: 0.003 there, 0.001 here", "nothing would train with this one",
                   "give a new run.dir to start a fresh run", "or raise train.steps")
    # The same config on a finished run still trains nothing and exits 0, as documented.
    assert main(["--config", TINY, *SMALL, "train.steps=2", f"run.dir={run_dir}"]) == 0
    assert "nothing to train" in capsys.readouterr().err

    # With steps left: it resumes with the new value, and says so in one line before the first step.
    summary = train(load_config(TINY, [*SMALL, *one_device, "train.steps=3", f"run.dir={run_dir}",
                                       "optimizer.learning_rate=1e-3"]), devices=jax.devices()[:1])
    assert summary["resumed_from"] == 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings
    for hint in (f"resuming run.dir {run_dir} from step 2", "optimizer.learning_rate: 0.003 there, 0.001 here",
                 "train.steps: 2 there, 3 here", "values apply from step 3 on",
                 f"give a new run.dir to start a fresh run (or delete {run_dir / 'checkpoints'})",
                 "--fresh makes resuming an error instead"):
        assert hint in warnings[0], (hint, warnings[0])
    # --fresh is the guard that never resumes.
    rc = main(["--fresh", "--config", TINY, *SMALL, "train.steps=3", f"run.dir={run_dir}"])
    one_line_error(rc, capsys.readouterr().err, "--fresh", "already holds checkpoints")


# --- a plugin family under tests/ without PYTHONPATH ---------------------------------------------------

def _without_pythonpath() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_the_toy_family_config_loads_without_pythonpath(tmp_path, where):
    cwd = REPO if where == "repo" else tmp_path
    config = "tests/toy_gpt.yaml" if where == "repo" else str(TOY)
    done = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", config, "--print-config"],
                          cwd=cwd, env=_without_pythonpath(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "family: toy_gpt" in done.stdout
    assert f"plugin: {TOY_FILE}" in done.stdout  # recorded absolute: a run's config.yaml finds it anywhere


def test_a_plugin_file_on_the_command_line_is_relative_to_the_current_directory():
    done = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", "configs/tiny.yaml",
                           "model.plugin=tests/toy_family.py", "model.family=toy_gpt", "model.num_kv_heads=2",
                           "--print-config"], cwd=REPO, env=_without_pythonpath(), capture_output=True, text=True,
                          timeout=300)
    one_line_error(done.returncode, done.stderr, "model.num_kv_heads", "is not a field of model.family 'toy_gpt'")


def test_a_plugin_file_is_recorded_by_path_and_reloads():
    cfg = load_config(str(TOY))
    saved = to_dict(cfg)["model"]
    assert (saved["family"], saved["plugin"]) == ("toy_gpt", str(TOY_FILE))
    assert load_config(None, [f"model.{key}={value}" for key, value in saved.items()]).model == cfg.model


def test_plugin_file_errors_are_one_line(tmp_path, capsys):
    rc = main(["--config", TINY, f"model.plugin={tmp_path / 'missing.py'}", "--print-config"])
    one_line_error(rc, capsys.readouterr().err, "model.plugin", f"no such file: {tmp_path / 'missing.py'}",
                   "relative to that file's directory")
    (tmp_path / "json.py").write_text("raise SystemExit('must not run')\n")
    rc = main(["--config", TINY, f"model.plugin={tmp_path / 'json.py'}", "--print-config"])
    one_line_error(rc, capsys.readouterr().err, "model.plugin", "as module 'json'", "rename the file")
    (tmp_path / "broken_plugin.py").write_text("import no_such_module_here\n")
    rc = main(["--config", TINY, f"model.plugin={tmp_path / 'broken_plugin.py'}", "--print-config"])
    one_line_error(rc, capsys.readouterr().err, "model.plugin", "No module named 'no_such_module_here'")
    assert "broken_plugin" not in sys.modules


# --- train-tokenizer with fewer tokens than asked ---------------------------------------------------------

def test_train_tokenizer_says_when_it_trained_fewer_tokens_than_asked(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(["alpha", "beta", "gamma", "delta"] * 300))
    assert data_main(["train-tokenizer", "--input", str(corpus), "--vocab-size", "1000", "--out",
                      str(tmp_path / "tok")]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "tok" / "tokenizer.json")
    size = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).get_vocab_size()
    assert size < 1000
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: --vocab-size: the tokenizer has {size:,} of the "
                                                   "1,000 tokens asked"), err
    assert f"model.vocab_size >= {size:,}" in lines[0]
    # Asked for no more than it can make: nothing to say.
    assert data_main(["train-tokenizer", "--input", str(corpus), "--vocab-size", "260", "--out",
                      str(tmp_path / "small")]) == 0
    assert capsys.readouterr().err == ""


# --- bench_pipeline.py leaves tracked files alone ---------------------------------------------------------

def test_bench_pipeline_writes_under_runs_by_default_and_the_docs_name_their_figure():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_pipeline.py"), "--help"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "runs/bench_pipeline.png" in " ".join(done.stdout.split())
    docs = (REPO / "docs" / "pipeline.md").read_text()
    commands = [line for line in docs.splitlines() if "scripts/bench_pipeline.py" in line]
    assert commands and all("--out docs/img/pipeline_bench.png" in line for line in commands)
