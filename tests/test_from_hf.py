"""``model.from_hf=DIR`` (meshtrain/config.py; issue 52, item 3): the model section of a Hugging Face
``config.json`` through its family's HF adapter (``HFAdapter.config_from_hf``), so a user does not copy
widths by hand. The architecture (``HFAdapter.architecture_fields``) and the family come from the HF
config; the other model fields keep what the config files set; explicit ``model.*`` overrides win over
both. A bad directory is one line naming ``model.from_hf``. The ``config.json`` files are tiny ones the
tests write; nothing compiles.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import yaml

from meshtrain.weights import hf
from meshtrain.config import annotated_yaml, load_config, resolve_config
from meshtrain.train import main
from models.common import RematPolicy
from models.llama.model import LlamaConfig
from models.experts import Dispatch
from utils import one_line_error

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY, MOE_TINY = str(REPO / "configs" / "tiny.yaml"), str(REPO / "configs" / "moe_tiny.yaml")
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 96,
         "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 320, "hidden_size": 64,
           "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 4096}


def hf_dir(root: pathlib.Path, config: dict | str, name: str = "hf") -> str:
    directory = root / name
    directory.mkdir()
    (directory / hf.CONFIG_FILE).write_text(config if isinstance(config, str) else json.dumps(config))
    return str(directory)


def test_the_model_section_is_the_hf_configs(tmp_path):
    directory = hf_dir(tmp_path, LLAMA)
    model = load_config(None, [f"model.from_hf={directory}"]).model
    assert model == hf.model_config(LLAMA)  # the family's adapter, as an import reads it
    assert (type(model), model.vocab_size, model.embed_dim, model.num_layers, model.num_heads, model.num_kv_heads,
            model.head_dim, model.mlp_dim, model.rope_theta, model.norm_eps, model.tie_embeddings,
            model.seq_len) == (LlamaConfig, 256, 96, 3, 6, 2, 16, 160, 500000.0, 1e-5, True, 512)


@pytest.mark.parametrize("order", ["from_hf-first", "from_hf-last"])
def test_explicit_overrides_win_wherever_they_stand(tmp_path, order):
    directory = hf_dir(tmp_path, LLAMA)
    given = ["model.num_layers=1", "model.seq_len=64", "model.remat=full"]
    overrides = [f"model.from_hf={directory}", *given] if order == "from_hf-first" else [*given,
                                                                                           f"model.from_hf={directory}"]
    model = load_config(TINY, overrides).model
    assert (model.num_layers, model.seq_len, model.remat) == (1, 64, RematPolicy.FULL)
    assert (model.embed_dim, model.mlp_dim, model.vocab_size) == (96, 160, 256)  # the rest from config.json


def test_the_files_architecture_gives_way_and_their_other_model_fields_stay(tmp_path):
    """tiny.yaml's widths (embed 64, mlp 192, vocab 128) are replaced; a file's remat and seq_len, which
    HF does not record, stay."""
    directory = hf_dir(tmp_path, LLAMA)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"base": TINY, "model": {"remat": "full", "seq_len": 128, "embed_dim": 999}}))
    model = load_config(config, [f"model.from_hf={directory}"]).model
    assert (model.embed_dim, model.mlp_dim, model.vocab_size, model.num_layers) == (96, 160, 256, 3)
    assert (model.remat, model.seq_len) == (RematPolicy.FULL, 128)


def test_from_hf_in_a_file_under_the_fields_beside_it(tmp_path):
    directory = hf_dir(tmp_path, LLAMA)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"base": TINY, "model": {"from_hf": directory, "num_layers": 2}}))
    cfg, sources = resolve_config(config)
    assert (cfg.model.num_layers, cfg.model.embed_dim, cfg.model.seq_len) == (2, 96, 64)  # seq_len: tiny.yaml's
    printed = {line.split(":")[0].strip(): line.split("#")[-1].strip()
               for line in annotated_yaml(cfg, sources).split("\noptimizer:")[0].splitlines()[1:]}
    assert printed["embed_dim"] == f"from {directory}/config.json"
    assert printed["num_layers"] == f"from {config}" and printed["seq_len"] == f"from {TINY}"


def test_the_family_comes_from_the_hf_config(tmp_path):
    """A Mixtral config.json over moe_tiny.yaml: the MoE architecture from HF, moe_tiny's routing (a
    capacity dispatch in groups of 16, not an import's dropless default) kept; over tiny.yaml (Llama):
    the moe family."""
    directory = hf_dir(tmp_path, MIXTRAL)
    model = load_config(MOE_TINY, [f"model.from_hf={directory}"]).model
    assert (model.num_experts, model.top_k, model.expert_mlp_dim, model.embed_dim, model.vocab_size) == (
        4, 2, 48, 64, 320)
    assert (model.dispatch, model.group_size) == (Dispatch.CAPACITY, 16)
    assert load_config(TINY, [f"model.from_hf={directory}"]).model == dataclasses.replace(hf.model_config(MIXTRAL),
                                                                                         seq_len=64)
    llama = hf_dir(tmp_path, LLAMA, "llama")
    assert type(load_config(MOE_TINY, [f"model.from_hf={llama}"]).model) is LlamaConfig  # MoE fields dropped


@pytest.mark.parametrize("value, config, hints", [
    ("{missing}", None, ["is not a directory", "give a Hugging Face model directory"]),  # long paths are cut
    ("3", None, ["3 is not a directory"]),
    ("{dir}", None, ["{dir} has no config.json; give a Hugging Face model directory"]),
    ("{dir}", "{not json", ["{dir}/config.json is not valid JSON"]),
    ("{dir}", {**LLAMA, "model_type": "gpt2"}, ["{dir}/config.json:model_type: 'gpt2' is not supported; supported:"]),
    ("{dir}", {k: v for k, v in LLAMA.items() if k != "hidden_size"},
     ["{dir}/config.json:hidden_size: is missing or not an integer"]),
], ids=["no-directory", "not-a-path", "no-config-json", "bad-json", "unsupported-type", "missing-key"])
def test_a_bad_directory_is_one_line_naming_model_from_hf(tmp_path, capsys, value, config, hints):
    directory = tmp_path / "hf"
    directory.mkdir()
    if config is not None:
        (directory / hf.CONFIG_FILE).write_text(config if isinstance(config, str) else json.dumps(config))
    fill = lambda text: text.format(missing=tmp_path / "missing", dir=directory)
    rc = main(["--config", TINY, f"model.from_hf={fill(value)}", "--print-config"])
    one_line_error(rc, capsys.readouterr().err, "model.from_hf", *map(fill, hints))


def test_a_family_that_contradicts_the_hf_config_is_one_line(tmp_path, capsys):
    directory = hf_dir(tmp_path, LLAMA)
    rc = main(["--config", TINY, f"model.from_hf={directory}", "model.family=moe", "--print-config"])
    one_line_error(rc, capsys.readouterr().err, "model.from_hf",
                   f"{directory} holds a model of family 'llama', not model.family 'moe'; drop model.family")
