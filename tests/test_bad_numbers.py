"""Numbers that cannot be meant are one-line errors (exit 2) before anything is built: non-finite
config values, Adam settings that divide by zero, NaN, Infinity or 1e999 in an HF config.json,
integer or non-finite HF weights, mixture weights whose sum or share is no float, schedule tables
with non-integer counts. An update that leaves non-finite parameters from finite gradients is
measured and stops the run before its state is saved.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from meshtrain.errors import ConfigError
from meshtrain.loop import train
from meshtrain.policies import NonFiniteStop
from meshtrain.train import main
from utils import (TINY, complete_steps, config, flat_params, initial_state, overrides, refused_from_hf, restore,
                   tiny_hf, trainer_of_config)


NON_FINITE_FIELDS = ["optimizer.learning_rate", "optimizer.eps", "optimizer.weight_decay", "optimizer.b1",
                     "model.norm_eps", "model.rope_theta", "model.rope_scaling.factor",
                     "checkpoint.every_minutes", "data.markov_noise"]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan"])
@pytest.mark.parametrize("field", NON_FINITE_FIELDS)
def test_non_finite_config_values_are_one_line_errors(capsys, field, value):
    assert main(["--config", TINY, f"{field}={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {field}: must be a finite number, got "), err


def test_adam_settings_that_divide_by_zero_are_one_line_errors(capsys):
    for field, value, valid in (("optimizer.b1", "1.0", "[0, 1)"), ("optimizer.b2", "0.999999999", "[0, 1)"),
                                ("optimizer.eps", "0", "> 0")):
        assert main(["--config", TINY, f"{field}={value}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {field}: must be ") and valid in err, err


def _nan_learning_rate(cfg):
    """``cfg`` with a NaN learning rate, as code that bypasses the config loader could build it."""
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, learning_rate=math.nan))


def test_a_non_finite_update_from_finite_gradients_is_measured(tmp_path):
    """Finite loss and gradients: the update is applied in place and its result is checked, every new
    parameter and moment; a NaN learning rate (bypassing the config loader) fails that check."""
    from meshtrain.data import global_batch, make_dataset

    good = config(tmp_path, "optimizer.warmup_steps=0", steps=2)
    for cfg, finite in ((good, True), (_nan_learning_rate(good), False)):
        trainer = trainer_of_config(cfg)
        dataset = make_dataset(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
        state, metrics = trainer.train_step(initial_state(trainer),
                                            global_batch(dataset, 0, cfg.train.batch_size, trainer.batch_sharding))
        assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
        assert int(state.skipped_steps) == 0 and bool(metrics["state_finite"]) is finite
        assert all(np.isfinite(value).all() for value in flat_params(state).values()) is finite


@pytest.mark.parametrize("value, finite", [(1.0, True), (3e38, True), (math.inf, False), (-math.inf, False),
                                          (math.nan, False)])
def test_the_check_of_the_applied_state_is_exact(value, finite):
    """``state_finite``'s reduction: inf and NaN anywhere fail it, large finite values whose plain sum
    overflows (two of 3e38 in fp32) pass it; integer leaves are not checked, bf16 ones are."""
    import jax.numpy as jnp

    from meshtrain.trainer import all_finite

    tree = {"w": jnp.ones((4, 1000), jnp.float32).at[1, 7].set(value).at[3, 9].set(3e38),
            "count": jnp.int32(3), "half": jnp.ones((8,), jnp.bfloat16)}
    assert bool(all_finite(tree)) is finite
    assert not bool(all_finite({**tree, "half": tree["half"].at[2].set(jnp.inf)}))


@pytest.mark.parametrize("policy, every", [  # every: the step's own save, and the next step's check
    ("skip", 1), pytest.param("stop", 1, marks=pytest.mark.slow), pytest.param("skip", 100, marks=pytest.mark.slow),
    pytest.param("stop", 100, marks=pytest.mark.slow)], ids=["1-skip", "1-stop", "100-skip", "100-stop"])
def test_a_non_finite_update_stops_the_run_and_keeps_the_good_checkpoints(tmp_path, policy, every):
    """A run resumed from a good checkpoint with a NaN learning rate: step 2's update is applied
    (finite gradients) and leaves NaN; the run stops with exit status 3's error before saving it, under
    either policy, and checkpoint 1 is still there, bit for bit."""
    train(config(tmp_path, "checkpoint.every=1", steps=1))
    good = flat_params(restore(tmp_path, 1, config(tmp_path, steps=1)).state)
    cfg = _nan_learning_rate(config(tmp_path, f"train.on_nonfinite={policy}", f"checkpoint.every={every}",
                                    steps=4))
    with pytest.raises(NonFiniteStop, match=r"step 2 left non-finite parameters or optimizer moments .* "
                                            r"the newest checkpoint, .*checkpoints/1, holds the last good state"):
        train(cfg)
    assert complete_steps(tmp_path) == [1]
    for name, value in flat_params(restore(tmp_path, 1, cfg).state).items():
        np.testing.assert_array_equal(value, good[name], err_msg=name)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("change, key, shown", [
    ({"rope_theta": math.nan}, "rope_theta", "nan"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps", "inf"),
    ({"initializer_range": -math.inf}, "initializer_range", "-inf"),  # a key meshtrain does not read
    ({"rope_scaling": {**LLAMA3, "factor": math.nan}}, "rope_scaling.factor", "nan"),
], ids=["rope_theta-NaN", "rms_norm_eps-Infinity", "unread-key--Infinity", "nested-NaN"])
def test_non_finite_numbers_in_config_json_are_one_line_errors_naming_the_key(tmp_path, capsys,
                                                                                            change, key, shown):
    """Python's json reads NaN and Infinity (json.dumps writes them so); an import took them as the
    model's rope_theta / norm_eps."""
    source = tiny_hf(tmp_path / "hf", config=change)
    assert "NaN" in (source / "config.json").read_text() or "Infinity" in (source / "config.json").read_text()
    assert refused_from_hf(source, tmp_path / "out", capsys) == (f"error: config.json:{key}: must be a finite number, "
                                                          f"got {shown}\n")


def test_a_number_too_large_for_a_float_in_config_json_is_refused(tmp_path, capsys):
    source = tiny_hf(tmp_path / "hf", config={"rope_theta": 12345.5})
    config = source / "config.json"
    config.write_text(config.read_text().replace("12345.5", "1e999"))  # Python's json reads it as inf
    expected = "error: config.json:rope_theta: must be a finite number, got inf\n"
    assert refused_from_hf(source, tmp_path / "out", capsys) == expected


@pytest.mark.usefixtures("no_compile")
def test_a_non_finite_config_json_stops_a_fine_tune_before_it_compiles(tmp_path, capsys):
    source = tiny_hf(tmp_path / "hf", config={"rms_norm_eps": math.nan})
    assert main(["--config", TINY, *overrides(tmp_path / "run", f"checkpoint.init_from=hf:{source}")]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint.init_from: {source}: config.json:rms_norm_eps: must be a "
                                       "finite number, got nan\n")


@pytest.mark.parametrize("dtype, shown", [(np.int32, "int32"), (np.int64, "int64"), (np.uint8, "uint8"),
                                          (np.bool_, "bool")])
def test_integer_and_bool_weights_are_one_line_errors_naming_the_tensor(tmp_path, capsys, dtype, shown):
    """They were cast to float without a word (a quantized checkpoint's int8 weights became numbers ~100)."""
    name = "model.layers.1.mlp.down_proj.weight"
    source = tiny_hf(tmp_path / "hf", edit=lambda tensors: tensors.update({name: tensors[name].astype(dtype)}))
    assert refused_from_hf(source, tmp_path / "out", capsys) == (
        f"error: --hf: tensor {name} in {source} is {shown}, not floating point; weights must be float32, bfloat16 "
        "or float16 (quantized checkpoints are not supported)\n")


def _poison(name, value, dtype=np.float32):
    def edit(tensors):
        tensors[name] = tensors[name].astype(dtype)
        tensors[name][3, 5] = value
    return edit


@pytest.mark.parametrize("value, dtype", [(math.nan, np.float32), (math.inf, np.float16), (-math.inf, np.float32)],
                         ids=["nan-f32", "inf-f16", "-inf-f32"])
def test_nan_or_infinite_weights_are_one_line_errors_naming_the_tensor(tmp_path, capsys, value, dtype):
    name = "model.layers.1.self_attn.k_proj.weight"
    source = tiny_hf(tmp_path / "hf", edit=_poison(name, value, dtype))
    err = refused_from_hf(source, tmp_path / "out", capsys)
    assert err.count("\n") == 1 and err.startswith(f"error: --hf: tensor {name} in {source} holds NaN or infinite "
                                                   "values (1 of the "), err
    assert err.endswith(" read); the checkpoint is damaged, and no model can be trained or run from it\n"), err


def test_a_fine_tune_from_nan_weights_is_refused_at_import_not_blamed_on_the_optimizer(tmp_path,
                                                                                                     capsys):
    name = "model.embed_tokens.weight"
    source = tiny_hf(tmp_path / "hf", edit=_poison(name, math.nan))
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run_dir, f"checkpoint.init_from=hf:{source}", steps=2)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint.init_from: tensor {name} in {source} holds NaN "
                                               "or infinite values (1 of the "), err
    assert complete_steps(run_dir) == [] and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, field, hint", [
    (["data.mixture=[{path: a, weight: 1.0e+308}, {path: b, weight: 1.0e+308}]"], "data.mixture", "sum to inf"),
    (["data.mixture=[{path: a, weight: 5.0e-324}, {path: b, weight: 1}]"], "data.mixture[0].weight", "underflows"),
], ids=["sum-overflows", "share-underflows"])
def test_mixture_weights_whose_sum_or_share_is_not_a_float_are_one_line(overrides, field, hint):
    from meshtrain.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.source=tokens", *overrides])
    assert info.value.field == field and hint in info.value.message, info.value


@pytest.mark.parametrize("stages", ["Infinity", "1e400", "2.5", "true", "-1"])
def test_a_pipeline_table_with_a_non_integer_count_is_one_line(tmp_path, stages):
    from meshtrain.parallel.schedules import ScheduleTable, gpipe

    text = gpipe(2, 2).to_json().replace('"stages": 2', f'"stages": {stages}', 1)
    assert f'"stages": {stages}' in text
    with pytest.raises(ConfigError) as info:
        ScheduleTable.from_json(text)
    assert info.value.field == "pipeline.table" and "is not an integer >= 0" in info.value.message
