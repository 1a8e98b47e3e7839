"""Config inheritance (issue 39 item 3): ``base: FILE`` in a YAML config, a chain of any length with
paths relative to the naming file; mappings merge key by key, lists and scalars replace, the
overrides come last; bad bases are one-line errors (exit 2); ``--print-config`` says where each
value came from and reads back to the same config.

Nothing here trains or compiles: ``meshtrain.train.train`` is patched to fail the test if reached.
"""

from __future__ import annotations

import pathlib

import pytest
import yaml

import meshtrain.train
from meshtrain.config import SECTIONS, load_config, resolve_config
from meshtrain.errors import ConfigError

ROOT = """\
mesh: {data: 2, fsdp: 2, tensor: 2}
model:
  vocab_size: 128
  embed_dim: 64
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  head_dim: 16
  mlp_dim: 192
  seq_len: 64
  remat_names: [query, key]
sharding:
  rules:
    vocab: {params: null, activations: tensor}
train: {steps: 50, batch_size: 32, log_every: 5}
eval: {every: 10}
"""
MID = """\
base: base/root.yaml
model: {num_layers: 4}
train: {steps: 100}
data: {seed: 3}
"""
CHILD = """\
base: ../shared/mid.yaml
model:
  embed_dim: 32
  remat_names: [attention]
train: {steps: 7}
eval:
"""


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the command reached training")

    monkeypatch.setattr(meshtrain.train, "train", fail)


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.fixture
def chain(tmp_path, monkeypatch):
    """configs/child.yaml -> shared/mid.yaml -> shared/base/root.yaml, the working directory tmp_path."""
    _write(tmp_path, {"configs/child.yaml": CHILD, "shared/mid.yaml": MID, "shared/base/root.yaml": ROOT})
    monkeypatch.chdir(tmp_path)
    return "configs/child.yaml"


def _error(argv: list[str], capsys) -> str:
    """The one stderr line of ``train`` refusing ``argv`` with exit status 2."""
    assert meshtrain.train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def test_a_three_level_chain_in_different_directories_merges_field_by_field(chain):
    cfg = load_config(chain)
    model = cfg.model
    assert (model.embed_dim, model.num_layers, model.vocab_size, model.mlp_dim) == (32, 4, 128, 192)  # child, mid, root
    assert model.remat_names == ("attention",)  # a list replaces the base's whole
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.log_every) == (7, 32, 5)
    assert cfg.data.seed == 3 and (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 2, 2)
    assert cfg.sharding.rules["vocab"].activations == "tensor"
    assert cfg.eval.every == 10  # the child's empty `eval:` keeps the base's section
    assert cfg == load_config(None, ["mesh={data: 2, fsdp: 2, tensor: 2}", "model.vocab_size=128",
                                     "model.embed_dim=32", "model.num_layers=4", "model.num_heads=4",
                                     "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=192",
                                     "model.seq_len=64", "model.remat_names=[attention]",
                                     "sharding.rules.vocab={params: null, activations: tensor}",
                                     "train={steps: 7, batch_size: 32, log_every: 5}", "eval.every=10",
                                     "data.seed=3"])


def test_a_nested_mapping_merges_key_by_key(tmp_path):
    _write(tmp_path, {"root.yaml": ROOT, "child.yaml": "base: root.yaml\nsharding:\n  rules:\n"
                      "    vocab: {params: fsdp}\n    mlp: {params: null, activations: null}\n"})
    rules = load_config(tmp_path / "child.yaml").sharding.rules
    assert (rules["vocab"].params, rules["vocab"].activations) == ("fsdp", "tensor")
    assert (rules["mlp"].params, rules["mlp"].activations) == (None, None)


def test_overrides_apply_after_the_whole_chain(chain):
    cfg = load_config(chain, ["train.steps=9", "model.num_layers=6", "model.remat_names=[mlp_hidden]"])
    assert (cfg.train.steps, cfg.model.num_layers, cfg.model.embed_dim) == (9, 6, 32)
    assert cfg.model.remat_names == ("mlp_hidden",)


def test_an_absolute_base_path(tmp_path):
    _write(tmp_path, {"a/root.yaml": ROOT, "b/child.yaml": f"base: {tmp_path / 'a' / 'root.yaml'}\n"
                                                           "train: {steps: 3}\n"})
    cfg = load_config(tmp_path / "b" / "child.yaml")
    assert (cfg.train.steps, cfg.train.batch_size, cfg.model.mlp_dim) == (3, 32, 192)


def test_base_does_not_appear_in_the_resolved_config(chain, capsys):
    assert meshtrain.train.main(["--config", chain, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert "base" not in printed and list(printed) == list(SECTIONS)


def test_a_missing_base_names_the_file_that_refers_to_it(tmp_path, monkeypatch, capsys):
    _write(tmp_path, {"configs/child.yaml": "base: ../nowhere/base.yaml\n"})
    monkeypatch.chdir(tmp_path)
    assert _error(["--config", "configs/child.yaml"], capsys) == (
        "error: base: no such file: nowhere/base.yaml (the base named in configs/child.yaml)")


def test_an_unreadable_base(tmp_path, monkeypatch, capsys):
    """(Simulated: the tests may run as root, whom file modes do not stop.)"""
    _write(tmp_path, {"child.yaml": "base: secret.yaml\n", "secret.yaml": "train: {steps: 3}\n"})
    monkeypatch.chdir(tmp_path)
    read_text = pathlib.Path.read_text

    def refuse(self, *args, **kwargs):
        if self.name == "secret.yaml":
            raise PermissionError(13, "Permission denied")
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", refuse)
    assert _error(["--config", "child.yaml"], capsys) == (
        "error: base: cannot read secret.yaml: Permission denied (the base named in child.yaml)")


def test_a_base_two_levels_down_that_is_a_directory(chain, capsys):
    (pathlib.Path("shared/base/dir.yaml")).mkdir()
    pathlib.Path("shared/base/root.yaml").write_text("base: dir.yaml\n")
    assert _error(["--config", chain], capsys) == (
        "error: base: shared/base/dir.yaml is a directory; give a YAML config file "
        "(the base named in shared/base/root.yaml)")


@pytest.mark.parametrize("files, expected", [
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, "a.yaml -> b.yaml -> a.yaml"),
    ({"a.yaml": "base: ./a.yaml\n"}, "a.yaml -> a.yaml"),
    ({"a.yaml": "base: sub/b.yaml\n", "sub/b.yaml": "base: c.yaml\n", "sub/c.yaml": "base: ../sub/b.yaml\n"},
     "a.yaml -> sub/b.yaml -> sub/c.yaml -> sub/b.yaml"),
], ids=["two-files", "itself", "into-a-subdirectory"])
def test_a_cycle_is_one_line_listing_the_chain(tmp_path, monkeypatch, capsys, files, expected):
    _write(tmp_path, files)
    monkeypatch.chdir(tmp_path)
    assert _error(["--config", "a.yaml"], capsys) == (
        f"error: base: the base files form a cycle: {expected}; remove one of their base: keys")


@pytest.mark.parametrize("value, shown", [("3", "3"), ("[a.yaml]", "['a.yaml']"), ("", "None"), ("''", "''"),
                                          ("{path: a.yaml}", "{'path': 'a.yaml'}")])
def test_a_base_that_is_not_a_path(tmp_path, monkeypatch, capsys, value, shown):
    _write(tmp_path, {"child.yaml": f"base: {value}\ntrain: {{steps: 3}}\n"})
    monkeypatch.chdir(tmp_path)
    assert _error(["--config", "child.yaml"], capsys) == (
        "error: base: must be the path of a YAML config file (relative to the directory of child.yaml, "
        f"or absolute), got {shown} in child.yaml")


def test_a_base_that_is_not_a_mapping(tmp_path, monkeypatch, capsys):
    _write(tmp_path, {"child.yaml": "base: list.yaml\n", "list.yaml": "- train\n- model\n"})
    monkeypatch.chdir(tmp_path)
    assert _error(["--config", "child.yaml"], capsys) == (
        f"error: base: list.yaml must hold a mapping of sections {list(SECTIONS)} (the base named in child.yaml)")


@pytest.mark.parametrize("text, problem", [
    ("mesh: {data: 2\n", "list.yaml is not valid YAML: expected ',' or '}', but got '<stream end>' at line 2, "
                         "column 1"),
    ("a: 1\na: 2\n", "list.yaml is refused: key 'a' appears twice in one mapping (line 2)"),
], ids=["syntax", "duplicate-key"])
def test_a_base_that_is_bad_yaml_reuses_the_loaders_errors(tmp_path, monkeypatch, capsys, text, problem):
    _write(tmp_path, {"child.yaml": "base: list.yaml\n", "list.yaml": text})
    monkeypatch.chdir(tmp_path)
    assert _error(["--config", "child.yaml"], capsys) == f"error: base: {problem} (the base named in child.yaml)"


def test_base_is_not_an_override(chain, capsys):
    assert _error(["--config", chain, "base=other.yaml"], capsys) == (
        "error: base: names a base config inside a YAML file (base: FILE), not as an override")


def test_a_bad_field_in_a_base_is_reported_as_before(chain):
    pathlib.Path("shared/mid.yaml").write_text(MID + "optimizer: {learnig_rate: 0.1}\n")
    with pytest.raises(ConfigError, match=r"^optimizer\.learnig_rate: unknown field"):
        load_config(chain)


def test_print_config_says_where_each_value_came_from(chain, capsys):
    assert meshtrain.train.main(["--config", chain, "--print-config", "train.log_every=2",
                                 "sharding.rules.mlp={params: null}"]) == 0
    lines = capsys.readouterr().out.splitlines()

    def origin(key: str, value: str) -> str:
        (line,) = [line for line in lines if line.split("#")[0].strip() == f"{key}: {value}"]
        return line.split("  # ", 1)[1]

    assert origin("embed_dim", "32") == "from configs/child.yaml"
    assert origin("num_layers", "4") == "from shared/mid.yaml"
    assert origin("mlp_dim", "192") == "from shared/base/root.yaml"
    assert origin("remat_names", "[attention]") == "from configs/child.yaml"
    assert origin("log_every", "2") == "from the command line"
    assert origin("grad_accum", "1") == "default"
    assert origin("every", "10") == "from shared/base/root.yaml"  # eval.every, under the child's empty eval:
    assert origin("family", "llama") == "default"
    # sharding.rules: vocab from the root file, mlp from the command line, its left-out column a default
    start = lines.index("  rules:")
    assert [line.split("#")[0].rstrip() for line in lines[start + 1:start + 7]] == [
        "    vocab:", "      params: null", "      activations: tensor", "    mlp:", "      params: null",
        "      activations: null"]
    assert [line.split("  # ")[-1] for line in lines[start + 2:start + 7] if "#" in line] == [
        "from shared/base/root.yaml", "from shared/base/root.yaml", "from the command line", "default"]
    assert all(line.endswith(":") or "  # " in line for line in lines)  # every value has its origin


def test_printed_config_loads_back_to_the_same_config(chain, capsys, tmp_path):
    overrides = ["train.steps=9", "run.dir=runs/a #b", "data.mixture=[]", "optimizer.eps=1e-6",
                 "model.init_from=null", "checkpoint.every=7"]
    (tmp_path / "odd\nbase.yaml").write_text("base: shared/mid.yaml\n")  # a line break in a file name
    (tmp_path / "odd.yaml").write_text("base: \"odd\\nbase.yaml\"\nrun: {dir: \"a\\nb # c: d\"}\n")
    for config in [chain, "odd.yaml"]:
        assert meshtrain.train.main(["--config", config, "--print-config", *overrides[:1]]) == 0
        printed = capsys.readouterr().out
        (tmp_path / "printed.yaml").write_text(printed)
        assert load_config(tmp_path / "printed.yaml") == load_config(config, overrides[:1])
    assert load_config("odd.yaml").run.dir == "a\nb # c: d"
    assert meshtrain.train.main(["--config", chain, "--print-config", *overrides]) == 0
    (tmp_path / "printed.yaml").write_text(capsys.readouterr().out)
    assert load_config(tmp_path / "printed.yaml") == load_config(chain, overrides)


def test_an_alias_is_attributed_where_it_is_stored(tmp_path):
    """``model.init_from`` is stored (and printed) as ``checkpoint.init_from``: so is its origin."""
    _write(tmp_path, {"root.yaml": ROOT, "child.yaml": "base: root.yaml\nmodel: {init_from: hf:/x}\n"})
    cfg, sources = resolve_config(tmp_path / "child.yaml")
    assert cfg.checkpoint.init_from == "hf:/x"
    assert sources["checkpoint"]["init_from"] == f"from {tmp_path / 'child.yaml'}"
    assert "init_from" not in sources["model"]


@pytest.mark.parametrize("special", ["fifo", "device"])
def test_a_base_that_is_a_fifo_or_a_device_is_named_as_such(tmp_path, monkeypatch, capsys, special):
    """Issue 53, item 10: not "no such file", and a FIFO is not read (which would wait for a writer)."""
    import os

    target = "/dev/null"
    if special == "fifo":
        target = str(tmp_path / "pipe")
        os.mkfifo(target)
    _write(tmp_path, {"child.yaml": f"base: {target}\n"})
    monkeypatch.chdir(tmp_path)
    assert _error(["--config", "child.yaml"], capsys) == (
        f"error: base: {target} is not a regular file (a device, FIFO or socket); give a YAML config file (the "
        "base named in child.yaml)")
