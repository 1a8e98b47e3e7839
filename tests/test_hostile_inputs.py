"""Hostile inputs to ``meshtrain.train`` and ``meshtrain.convert`` (a YAML alias bomb, deep nesting,
huge integers, paths that are files, FIFOs, loops or /proc, damaged .npy files, damaged HF
indexes, ...): each is one ``error:`` line, exit 2, no traceback, within a minute.
"""

from __future__ import annotations

import time

import numpy as np

from meshtrain.train import main
from utils import TINY


def _hostile_inputs(root):
    """(name, argv of meshtrain.train or ("convert", argv)) for the hostile-input test; files under root."""
    import json
    import os

    def write(name, content):
        path = root / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        return str(path)

    laughs = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 8))
    bomb = write("bomb.yaml", "l0: &l0 [x, x, x, x, x, x, x, x, x]\n" + laughs + "model: {remat_names: *l7}\n")
    digits = "1" * 5000
    a_file = write("a_file", "x")
    loop = root / "loop"
    os.symlink(loop, loop)
    os.symlink(root / "nowhere", root / "broken.npy")
    os.mkfifo(root / "fifo.npy")
    np.save(root / "good.npy", np.arange(1000, dtype=np.int32))
    good = (root / "good.npy").read_bytes()
    np.save(root / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(root / "float2d.npy", np.zeros((4, 4), np.float32))
    tokens = ["data.source=tokens", "data.path="]
    cases = {
        "alias-bomb": ["--config", bomb],
        "deep-nesting": ["--config", write("deep.yaml", "a: " + "[" * 20000 + "]" * 20000)],
        "duplicate-keys": ["--config", write("dup.yaml", "train: {steps: 3}\ntrain: {steps: 4}\n")],
        "binary-config": ["--config", write("binary.yaml", bytes(range(256)))],
        "huge-int-in-file": ["--config", write("bigint.yaml", f"train: {{steps: {digits}}}\n")],
        "huge-int-override": ["--config", TINY, f"train.steps={digits}"],
        "seed-2**70": ["--config", TINY, f"train.seed={2 ** 70}"],
        "batch-2**70": ["--config", TINY, f"train.batch_size={2 ** 70}"],
        "vocab-2**64": ["--config", TINY, f"model.vocab_size={2 ** 64}"],
        "negative-layers": ["--config", TINY, "model.num_layers=-1"],
        "zero-seq-len": ["--config", TINY, "model.seq_len=0"],
        "run-dir-is-a-file": ["--config", TINY, f"run.dir={a_file}"],
        "run-dir-under-a-file": ["--config", TINY, f"run.dir={a_file}/run"],
        "run-dir-in-proc": ["--config", TINY, "run.dir=/proc/meshtrain-run"],
        "run-dir-name-too-long": ["--config", TINY, f"run.dir={root / ('r' * 300)}"],
        "host-devices-100000": ["--host-devices", "100000", "--config", TINY],
        "data-path-directory": ["--config", TINY, *tokens[:1], f"data.path={root}"],
        "data-path-fifo": ["--config", TINY, *tokens[:1], f"data.path={root / 'fifo.npy'}"],
        "data-path-symlink-loop": ["--config", TINY, *tokens[:1], f"data.path={loop}"],
        "data-path-broken-link": ["--config", TINY, *tokens[:1], f"data.path={root / 'broken.npy'}"],
        "npy-truncated": ["--config", TINY, *tokens[:1], f"data.path={write('trunc.npy', good[:200])}"],
        "npy-header-only": ["--config", TINY, *tokens[:1], f"data.path={write('header.npy', good[:128])}"],
        "npy-random": ["--config", TINY, *tokens[:1],
                       f"data.path={write('random.npy', np.random.default_rng(0).bytes(999))}"],
        "npy-pickled": ["--config", TINY, *tokens[:1], f"data.path={root / 'pickled.npy'}"],
        "npy-float-2d": ["--config", TINY, *tokens[:1], f"data.path={root / 'float2d.npy'}"],
        "bin-odd-size": ["--config", TINY, *tokens[:1], "data.token_dtype=uint16",
                         f"data.path={write('odd.bin', b'abc')}"],
        "nan-learning-rate": ["--config", TINY, "optimizer.learning_rate=.nan"],
        "unknown-family": ["--config", TINY, "model.family=nope"],
        "missing-plugin": ["--config", TINY, "model.plugin=no.such.plugin"],
        "rule-for-unknown-axis": ["--config", TINY, "sharding.rules.nope={params: fsdp}"],
        "mesh-product": ["--config", TINY, "mesh.data=3"],
        "missing-config": ["--config", str(root / "missing.yaml")],
        "config-is-a-directory": ["--config", str(root)],
        "yaml-syntax": ["--config", write("syntax.yaml", "mesh: {data: 2\n  bad: [\n")],
        "override-without-value": ["--config", TINY, "train.steps"],
        "unknown-flag": ["--config", TINY, "--bogus"],
        "bad-enum": ["--config", TINY, "train.precision=fp4"],
        "string-for-a-list": ["--config", TINY, "model.remat_names=attention"],
    }
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 64}
    from safetensors.numpy import save_file

    def hf_dir(name, *, index=None, config_text=None):
        path = root / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config) if config_text is None else config_text)
        save_file({"model.norm.weight": np.ones(64, np.float32)}, str(path / "model-00001-of-00001.safetensors"))
        if index is not None:
            (path / "model.safetensors.index.json").write_text(json.dumps(index))
        return ["from-hf", "--hf", str(path), "--out", str(root / f"{name}-out")]

    cases |= {
        "hf-index-is-a-list": ("convert", hf_dir("hf_list", index=[1, 2])),
        "hf-weight-map-is-a-list": ("convert", hf_dir("hf_map_list", index={"weight_map": ["a"]})),
        "hf-index-names-a-missing-tensor": ("convert", hf_dir(
            "hf_missing", index={"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}})),
        "hf-config-not-json": ("convert", hf_dir("hf_bad_json", index={}, config_text="{not json")),
        "hf-unknown-model-type": ("convert", hf_dir("hf_type", index={}, config_text=json.dumps(
            {**config, "model_type": "gpt-neox"}))),
    }
    return cases


def test_hostile_inputs_are_each_one_line_exit_2_and_quick(tmp_path, capsys):
    from meshtrain import convert

    cases = _hostile_inputs(tmp_path)
    assert len(cases) >= 40
    failures = []
    for name, argv in cases.items():
        start = time.monotonic()
        tool, argv = (convert.main, argv[1]) if isinstance(argv, tuple) else (main, argv)
        code = tool(argv)
        seconds = time.monotonic() - start
        out = capsys.readouterr()
        lines = out.err.splitlines()
        if not (code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out.err
                and seconds < 60):
            failures.append((name, code, round(seconds, 1), out.err[-300:]))
    assert failures == []
