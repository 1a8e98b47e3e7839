"""Sizes that cannot fit stop in one line before anything is allocated or compiled: a run far beyond
the device memory, a KV cache beyond it, an expert block larger than a step's tokens, a vocabulary
the tokenizers library cannot train.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshtrain.errors import ConfigError
from meshtrain.train import main
from utils import REPO, TINY, overrides, tiny_hf


@pytest.mark.usefixtures("no_compile")
@pytest.mark.parametrize("override", ["model.seq_len=2147483648", "model.num_layers=1000000000"],
                         ids=["seq_len-2**31", "num_layers-1e9"])
def test_a_run_far_beyond_the_device_memory_is_one_line_before_allocating(tmp_path, capsys, override):
    """meshtrain.plan's estimate of the run's own layout against the device memory (host RAM over the
    simulated devices here): more than 4x over is refused before anything is allocated or compiled
    (``no_compile``; the OOM killer took 62 s)."""
    assert main(["--config", TINY, *overrides(tmp_path / "run"), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model: this run needs about ") and "per device" in err[0], err
    assert "python -m meshtrain.plan" in err[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_kv_cache_beyond_the_device_memory_is_one_line(tmp_path):
    """``generate_tokens`` (what ``meshtrain.generate --max-new-tokens`` calls) sizes the KV cache
    from the prefill's abstract shapes before allocating anything (here 10**9 new tokens)."""
    import jax

    from meshtrain.generate import generate_tokens
    from meshtrain.weights.loading import load_model
    from meshtrain.mesh import MeshConfig, make_mesh
    from meshtrain.parallel.rules import Preset

    mesh = make_mesh(MeshConfig(1, 1, 1, 1), jax.devices()[:1])
    model = load_model(tiny_hf(tmp_path / "hf"), mesh, Preset.FSDP_TP.rules, field="--hf")
    with pytest.raises(ConfigError) as info:
        generate_tokens(model.graphdef, model.params, np.zeros((1, 2), np.int32), 10 ** 9)
    assert info.value.field == "--max-new-tokens"
    assert info.value.message.startswith("a KV cache of 1,000,000,002 positions needs ") and "ask for fewer" in \
        info.value.message


@pytest.mark.parametrize("config", ["moe_tiny.yaml", "deepseek_tiny.yaml"])
def test_an_expert_block_beyond_a_steps_tokens_is_one_line(tmp_path, capsys, config):
    """``model.expert_block=1000000`` made XLA abort (a buffer of experts x block rows): a block larger
    than the tokens of one step (train.batch_size / train.grad_accum x model.seq_len; no expert's rows
    fill it) is refused before anything is built; the largest valid one is accepted."""
    argv = ["--config", str(REPO / "configs" / config), "--print-sharding", "model.dispatch=dropless",
            "train.batch_size=32", "train.grad_accum=2", "model.seq_len=64", f"run.dir={tmp_path / 'run'}"]
    assert main([*argv, "model.expert_block=1000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: model.expert_block: 1,000,000 rows per block is more than the 1,024 tokens of one step "
                   "(train.batch_size 32 / train.grad_accum 2 x model.seq_len 64), which no expert's rows can "
                   "fill; use 1 to 1,024, or 0 to choose from the rows"), err
    assert main([*argv, "model.expert_block=1024"]) == 0
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("size", [str(2 ** 32 + 1), str(2 ** 31)])
def test_a_vocabulary_the_tokenizers_library_cannot_train_is_one_line(tmp_path, capsys, size):
    from meshtrain.data.__main__ import main as data_main

    (tmp_path / "a.txt").write_text("some text " * 20)
    assert data_main(["train-tokenizer", "--input", str(tmp_path / "a.txt"), "--vocab-size", size,
                      "--out", str(tmp_path / "tok")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --vocab-size: must be at most 2,147,483,647 (2**31 - 1), got {int(size):,}"], err
    assert not (tmp_path / "tok").exists()
