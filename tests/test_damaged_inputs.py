"""Damaged or forged inputs are found, not trusted: a checkpoint whose bytes, checksums or metadata were
damaged is set aside and the run resumes from the one before; an HF weight map or a prepared index
naming a file outside its directory, JSON nested past any reader's bound, a prepared corpus with ids
outside the vocabulary and a token file truncated while training are each one line.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshtrain.checkpoint import CHECKPOINT_DIR
from meshtrain.loop import train
from meshtrain.train import main
from utils import TINY, complete_steps, config, overrides, records, refused_from_hf, tiny_hf


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A 2-step run saving after each step: checkpoints 1 and 2, and its losses."""
    run_dir = tmp_path_factory.mktemp("two-checkpoints")
    train(config(run_dir, "checkpoint.every=1", steps=2))
    return run_dir, {r["step"]: r["loss"] for r in records(run_dir)}


def _flip_array_byte(step_dir):
    data = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with data.open("r+b") as f:
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))


def _recorded_checksum_differs(step_dir):
    """The values no longer match what was recorded at save (as after a flipped bit that still
    decodes): deterministic, unlike a flipped byte of compressed data, which the decoder may catch
    first."""
    import json

    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    name = sorted(meta["checksums"])[0]
    path.write_text(json.dumps({**meta, "checksums": {**meta["checksums"], name: meta["checksums"][name] ^ 1}}))


def _meta_config_not_a_mapping(step_dir):
    import json

    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "config": "not a mapping"}))


def _meta_without_checksums(step_dir):
    import json

    path = step_dir / "meta" / "metadata"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "checksums"}))


def _meta_checksums_not_a_mapping(step_dir):
    import json

    path = step_dir / "meta" / "metadata"
    path.write_text(json.dumps({**json.loads(path.read_text()), "checksums": [1, 2]}))


def _another_steps_files(step_dir):
    """Step 1's checkpoint files under step 2's directory name."""
    import shutil

    shutil.rmtree(step_dir)
    shutil.copytree(step_dir.parent / "1", step_dir)


def _meta_without_mesh(step_dir):
    import json

    path = step_dir / "meta" / "metadata"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "mesh"}))


@pytest.mark.parametrize("damage, reason", [
    (_flip_array_byte, ""),  # the decoder or the checksum catches it, whichever first
    (_recorded_checksum_differs, "does not match the checksum recorded when it was saved"),
    (_meta_config_not_a_mapping, "holds no config with a model section"),
    (_meta_without_mesh, "holds no mesh"),
    (lambda step_dir: (step_dir / "state" / "_METADATA").unlink(), "holds no array metadata"),
    (_meta_checksums_not_a_mapping, "checksums are not a mapping"),
    (_meta_without_checksums, "has lost its checksums"),
    (_another_steps_files, "its directory says step 2 but its state is step 1's"),
], ids=["flipped-array-byte", "checksum-mismatch", "meta-config-not-a-mapping", "meta-without-mesh",
        "state-metadata-deleted", "meta-checksums-not-a-mapping", "meta-without-checksums", "another-steps-files"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_checkpoints_are_unreadable_and_fall_back(two_checkpoints, tmp_path, capsys, damage, reason):
    import shutil

    source, expected = two_checkpoints
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    (tmp_path / "metrics.jsonl").unlink()
    damage(tmp_path / CHECKPOINT_DIR / "2")
    train(config(tmp_path, "checkpoint.every=1", steps=3))
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / CHECKPOINT_DIR / '2'} is unreadable (" in err and reason in err, err
    assert "trying step 1" in err and "resumed from" in err and f"{CHECKPOINT_DIR}/1 (step 1" in err
    assert (tmp_path / CHECKPOINT_DIR / "2.unreadable").is_dir()  # kept, not deleted
    redone = {r["step"]: r["loss"] for r in records(tmp_path)}
    assert redone[2] == expected[2]  # step 2 redone from the good step-1 state: the same loss


def test_a_token_file_truncated_while_training_saves_and_stops_in_one_line(tmp_path, monkeypatch, capsys):
    """A memory-mapped file that shrinks would kill the run with SIGBUS on the next read."""
    from meshtrain import loop

    data = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 128, 50_000).astype(np.uint16).tofile(data)
    real_batch = loop.global_batch

    def truncate_before_step_3(dataset, step, *args):
        if step == 3:
            with data.open("r+b") as f:
                f.truncate(64)
        return real_batch(dataset, step, *args)

    monkeypatch.setattr(loop, "global_batch", truncate_before_step_3)
    run_dir = tmp_path / "run"
    code = main(["--config", TINY, *overrides(run_dir, "data.source=tokens", f"data.path={data}",
                                              "data.token_dtype=uint16", "checkpoint.every=0", steps=6)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 2 and len(err) == 1, err
    assert f"error: data.path: {data} changed while training (100000 -> 64 bytes); the state after step 3 " \
           f"was saved to {run_dir / CHECKPOINT_DIR / '3'}" in err[0]
    assert complete_steps(run_dir) == [3]


@pytest.mark.parametrize("where", ["../good/model.safetensors", "{good}/model.safetensors", "sub/model.safetensors",
                                   ".."], ids=["dot-dot", "absolute", "subdirectory", "parent"])
def test_an_hf_weight_map_naming_a_file_outside_its_directory_is_refused(tmp_path, capsys, where):
    import json
    import shutil

    from meshtrain.weights import hf

    good = tiny_hf(tmp_path / "good")
    where = where.format(good=good)
    bad = tmp_path / "bad"
    (bad / "sub").mkdir(parents=True)
    shutil.copy(good / hf.CONFIG_FILE, bad / hf.CONFIG_FILE)
    shutil.copy(good / hf.SINGLE_FILE, bad / "sub" / hf.SINGLE_FILE)
    names = json.loads((good / hf.SINGLE_FILE).read_bytes()[8:8 + int.from_bytes(
        (good / hf.SINGLE_FILE).read_bytes()[:8], "little")])  # the safetensors header: every tensor
    names = ["model.embed_tokens.weight", *sorted(set(names) - {"__metadata__", "model.embed_tokens.weight"})]
    (bad / hf.INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(names, where)}))
    assert refused_from_hf(bad, tmp_path / "out", capsys) == (
        f"error: --hf: {bad / hf.INDEX_FILE}: weight_map puts model.embed_tokens.weight in {where!r}, which is not "
        f"a plain file name; shards must be files in {bad} (no directory part, not . or ..)\n")


@pytest.mark.usefixtures("no_compile")
@pytest.mark.parametrize("what, key", [("train shard", "shards"), ("tokenizer", "tokenizer")])
def test_a_prepared_index_naming_a_file_outside_its_directory_is_refused(prepared_corpus, tmp_path, capsys,
                                                                                        what, key):
    import json
    import shutil

    from meshtrain.data.prepared import INDEX_FILE

    good = prepared_corpus["good"]
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    index = json.loads((bad / INDEX_FILE).read_text())
    outside = f"../../{good.parent.name}/good/{'train-00000.bin' if key == 'shards' else 'tokenizer.json'}"
    assert (bad / outside).is_file()  # it would be read
    if key == "shards":
        index["splits"]["train"]["shards"][0]["file"] = outside
    else:
        index["tokenizer"]["file"] = outside
    (bad / INDEX_FILE).write_text(json.dumps(index))
    argv = ["--config", TINY, *overrides(tmp_path / "run", "data.source=tokens", f"data.path={bad}",
                                         "model.vocab_size=512")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"error: data.path: {bad / INDEX_FILE} names {what} file {outside!r}, which is "
                                       "not a plain file name in its directory (no directory part, not . or ..); "
                                       "prepare the corpus again\n")


DEEP = "[" * 100_000 + "]" * 100_000  # a RecursionError in Python's json


@pytest.mark.usefixtures("no_compile")
def test_deeply_nested_json_is_one_line_in_every_reader(prepared_corpus, tmp_path, capsys):
    """Every JSON file a user hands in: a jsonl line (prepare, train-tokenizer), a prepared
    index.json, pipeline.table, an HF config.json and its safetensors index, an export's meshtrain.json."""
    from meshtrain import convert
    from meshtrain.weights import hf
    from meshtrain.weights.export_format import EXPORT_META, PARAMS_DIR
    from meshtrain.data import __main__ as data_cli
    from meshtrain.data.prepared import INDEX_FILE

    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_text('{"text": "one fine document"}\n' + DEEP + "\n")
    index_dir = tmp_path / "prepared"
    index_dir.mkdir()
    (index_dir / INDEX_FILE).write_text(DEEP)
    table = tmp_path / "table.json"
    table.write_text(DEEP)
    config_dir = tiny_hf(tmp_path / "hf_config")
    (config_dir / hf.CONFIG_FILE).write_text(DEEP)
    index_hf = tiny_hf(tmp_path / "hf_index")
    (index_hf / hf.INDEX_FILE).write_text(DEEP)
    export = tmp_path / "export"
    (export / PARAMS_DIR).mkdir(parents=True)
    (export / EXPORT_META).write_text(DEEP)
    bounded = "nested more than 64 levels deep"
    pipeline = ["mesh.data=1", "mesh.stage=2", "model.num_layers=4", "train.batch_size=16", "pipeline.schedule=custom"]
    cases = [
        (data_cli.main, ["prepare", "--tokenizer", str(prepared_corpus["tokenizer"]), "--input", str(jsonl), "--out",
                         str(tmp_path / "out1"), "--no-progress"],
         f"error: --input: {jsonl}:2 is not a line of JSON (nested too deeply for Python to parse)"),
        (data_cli.main, ["train-tokenizer", "--input", str(jsonl), "--vocab-size", "260", "--out",
                         str(tmp_path / "out2")],
         f"error: --input: {jsonl}:2 is not a line of JSON (nested too deeply for Python to parse)"),
        (main, ["--config", TINY, *overrides(tmp_path / "run1", "data.source=tokens", f"data.path={index_dir}")],
         f"error: data.path: {index_dir / INDEX_FILE} is not JSON ({bounded}); prepare the corpus again"),
        (main, ["--config", TINY, *pipeline, f"pipeline.table={table}"],
         "error: pipeline.table: must be a JSON schedule table {stages, chunks, microbatches, ticks: [[{work: "
         f"F|B|I|W, tasks: [[microbatch, chunk] or null per stage]}}]]}}: ValueError: {bounded}"),
        (convert.main, ["from-hf", "--hf", str(config_dir), "--out", str(tmp_path / "out3")],
         f"error: --hf: {config_dir / hf.CONFIG_FILE} is not valid JSON: {bounded}"),
        (convert.main, ["from-hf", "--hf", str(index_hf), "--out", str(tmp_path / "out4")],
         f"error: --hf: {index_hf / hf.INDEX_FILE} is not a safetensors index (ValueError: {bounded}); expected "
         '{"weight_map": {tensor: file}}'),
        (convert.main, ["to-hf", "--from", str(export), "--out", str(tmp_path / "out5")],
         f"error: --from: cannot read {export / EXPORT_META}: {bounded}"),
    ]
    for tool, argv, expected in cases:
        assert (tool(argv), capsys.readouterr().err) == (2, expected + "\n"), argv


def test_json_files_are_bounded_like_the_yaml_config_and_jsonl_lines_are_not():
    from meshtrain import jsonio

    assert jsonio.loads("[" * 64 + "]" * 64) is not None
    with pytest.raises(ValueError, match=r"^nested more than 64 levels deep$"):
        jsonio.loads('{"a": ' + "[" * 64 + "]" * 64 + "}")
    assert jsonio.loads('{"text": "x", "meta": ' + "[" * 200 + "]" * 200 + "}", max_depth=None)["text"] == "x"
    with pytest.raises(ValueError, match=r"^nested too deeply for Python to parse$"):
        jsonio.loads(DEEP.encode(), max_depth=None)


@pytest.mark.usefixtures("no_compile")
@pytest.mark.parametrize("forged", [False, True], ids=["damaged-shard-byte", "forged-index"])
def test_a_prepared_corpus_with_ids_outside_the_vocabulary_stops_before_training(
        prepared_corpus, tmp_path, capsys, forged):
    """A shard byte changed to an id beyond the vocabulary: its SHA-256 no longer matches index.json;
    with the index forged to match, the id itself is found (one pass at start-up, before compiling).
    Either way one line naming data.path and the shard, exit 2."""
    import json
    import shutil

    from meshtrain.data.tokenizer import file_sha256

    corpus = tmp_path / "corpus"
    shutil.copytree(prepared_corpus["good"], corpus)
    shard = corpus / "train-00000.bin"
    ids = np.fromfile(shard, np.uint16)
    ids[5] = 60000
    ids.tofile(shard)
    if forged:
        index = json.loads((corpus / "index.json").read_text())
        index["splits"]["train"]["shards"][0]["sha256"] = file_sha256(shard)
        (corpus / "index.json").write_text(json.dumps(index))
    rc = main(["--config", TINY, *overrides(tmp_path / "run"), "data.source=tokens", f"data.path={corpus}",
               "model.vocab_size=300"])
    err = capsys.readouterr().err.strip().splitlines()
    expected = (f"error: data.path: {shard}: token id 60000 is not below the vocabulary size 300; the corpus is "
                "damaged or its index.json forged: prepare it again") if forged else \
        f"error: data.path: {shard}: SHA-256 differs from index.json; the shard changed"
    assert rc == 2 and err == [expected], err
