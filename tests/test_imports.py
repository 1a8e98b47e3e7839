"""The import graph of the house, read from the source (every import, also inside functions):
no cycles, no upward imports, no module importing a command-line module, scripts and tests never
importing each other (also not through importlib or a directory put on the path), and no test module
importing another.

``LAYERS`` is the architecture as data, lowest first: a module may import its own layer and the
layers below. An entry is a folder (a package: all its modules share the layer, unless a longer entry
places one elsewhere) or a module. A new module must be placed here, or the test names it;
docs/architecture.md shows the same table.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Collection

ROOT = pathlib.Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    # The family interface and the families (they import nothing of the framework).
    ("models",),
    # Leaves: errors, devices and mesh, precision, the typed sections no other section depends on,
    # and what every command line shares.
    ("meshtrain.errors", "meshtrain.precision", "meshtrain.mesh", "meshtrain.train_config", "meshtrain.optim",
     "meshtrain.metrics", "meshtrain.run_lock", "meshtrain.distributed", "meshtrain.cli", "meshtrain.jsonio",
     "meshtrain.yamlio", "meshtrain.trackers", "meshtrain.fp8_training", "meshtrain.lora"),
    # The objective: the batch, the chunked head's loss, the whole model's loss without a pipeline.
    ("meshtrain.loss",),
    # One file per parallelism concern (a pipeline's head runs the objective); the data pipeline.
    ("meshtrain.parallel", "meshtrain.data"),
    # What is built from a layout: the step, checkpoints, evaluation, the planner's estimate,
    # sampling with the KV cache, the XLA flags (combine thresholds from a layout's layer bytes).
    ("meshtrain.trainer", "meshtrain.checkpoint", "meshtrain.evaluation", "meshtrain.planner",
     "meshtrain.sampling", "meshtrain.xla_flags",
     "meshtrain.harness"),  # lm-eval's LM on a model; evaluation imports it only when eval.harness asks
    # The config of every section, and the weights' files beside it: Hugging Face (which model.from_hf
    # reads), the params-only export, PEFT adapters, and loading any of them onto a mesh for the tools.
    ("meshtrain.config", "meshtrain.weights"),
    # What a run and the tools are made of: where a run starts, its policies, the planner's search,
    # the step compiled for compile-only GPUs, and the measuring wing (benchmarks, FLOPs and HLO
    # readers: only scripts, tests and these tools use it).
    ("meshtrain.resume", "meshtrain.policies", "meshtrain.planner.search", "meshtrain.gpu_compile",
     "meshtrain.measure"),
    ("meshtrain.loop",),
    # Command-line modules (``python -m ...``): nothing imports them.
    ("meshtrain.train", "meshtrain.plan", "meshtrain.convert", "meshtrain.export", "meshtrain.logits",
     "meshtrain.generate", "meshtrain.compile", "meshtrain.evaluate", "meshtrain.data.__main__"),
]
COMMAND_LINES = set(LAYERS[-1])


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_modules() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for package in ("meshtrain", "models") for path in (ROOT / package).rglob("*.py")}


def _imports(path: pathlib.Path, modules: Collection[str] = ()) -> set[str]:
    """Every absolute module name ``path`` imports: ``from a import b`` gives ``a.b`` when that is one
    of ``modules``, else ``a``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
    return found


def _extends_sys_path(path: pathlib.Path) -> bool:
    """Whether ``path`` calls ``sys.path.insert`` or ``sys.path.append``."""
    return bool(_calls(path.read_text(), ("sys.path.insert", "sys.path.append")))


# Calls that import a module by name or by file, or put a directory on the path for one (pytest's
# ``monkeypatch.syspath_prepend``): how a test could load a script without an import statement.
INDIRECT_IMPORTS = ("import_module", "spec_from_file_location", "syspath_prepend")


def _calls(source: str, names: Collection[str]) -> list[str]:
    """The calls in Python ``source`` of a function whose dotted name, or its last part, is one of ``names``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in names or name.rsplit(".", 1)[-1] in names:
                found.append(name)
    return found


def _layer(module: str) -> int:
    """The index in LAYERS of the longest prefix naming ``module``."""
    best, best_length = None, -1
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} has no layer: place it in tests/test_imports.py's LAYERS"
    return best


def _graph() -> dict[str, set[str]]:
    modules = _package_modules()
    return {name: {target for target in _imports(path, modules) if target in modules and target != name}
            for name, path in modules.items()}


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_ones():
    upward = [(module, target) for module, targets in _graph().items() for target in targets
              if _layer(target) > _layer(module)]
    assert upward == []


def test_no_module_imports_a_command_line_module():
    assert [(m, t) for m, targets in _graph().items() for t in targets if t in COMMAND_LINES] == []


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append([*stack[stack.index(target):], target])
            elif target not in state:
                visit(target, [*stack, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_graph_is_read_for_real():
    """The readers above see the edges that exist (a reader that saw nothing would pass them all)."""
    graph = _graph()
    assert "meshtrain.trainer" in graph["meshtrain.loop"] and "meshtrain.config" in graph["meshtrain.loop"]
    assert _layer("meshtrain.parallel.layout") == 3 and _layer("meshtrain.train") == len(LAYERS) - 1
    assert "meshtrain.loss" in graph["meshtrain.parallel.pipeline"]  # the objective sits below the pipeline


def test_the_layer_table_in_the_docs_is_the_tests():
    """docs/architecture.md's layer table lists LAYERS, row by row in the same order."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = text.split("<!-- layers:", 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    assert [tuple(cell.strip(" `") for cell in row.split("|")[2].split(",")) for row in rows] == LAYERS


def test_scripts_and_tests_do_not_import_each_other():
    """Neither by an import statement, nor by importlib, nor by a directory put on the path."""
    scripts = {path.stem for path in (ROOT / "scripts").glob("*.py")}
    tests = {path.stem for path in (ROOT / "tests").glob("*.py")}
    found = []
    for path in (ROOT / "tests").glob("*.py"):
        found += [(path.name, name) for name in _imports(path) if name.split(".")[0] in scripts]
        if _extends_sys_path(path):
            found.append((path.name, "sys.path"))
        found += [(path.name, call) for call in _calls(path.read_text(), INDIRECT_IMPORTS)]
    for path in (ROOT / "scripts").glob("*.py"):
        found += [(path.name, name) for name in _imports(path) if name.split(".")[0] in tests]
        if _extends_sys_path(path):
            found.append((path.name, "sys.path"))
        found += [(path.name, call) for call in _calls(path.read_text(), INDIRECT_IMPORTS)]
    assert found == []


def test_the_indirect_imports_are_seen():
    """The reader above sees importlib's and pytest's ways (a reader that saw nothing would pass it)."""
    sample = ("import importlib, importlib.util\nimportlib.import_module('bench')\n"
              "importlib.util.spec_from_file_location('x', 'scripts/x.py')\n"
              "def test(monkeypatch):\n    monkeypatch.syspath_prepend('scripts')\n")
    assert _calls(sample, INDIRECT_IMPORTS) == ["importlib.import_module", "importlib.util.spec_from_file_location",
                                                "monkeypatch.syspath_prepend"]


def test_no_test_module_imports_another():
    """What test modules share lives in tests/utils.py, tests/hf_reference.py (transformers' reference)
    and tests/conftest.py (fixtures): a test module imports no ``test_*`` module."""
    tests = {path.stem for path in (ROOT / "tests").glob("test_*.py")}
    found = [(path.name, name) for path in (ROOT / "tests").glob("*.py")
             for name in _imports(path) if name.split(".")[0] in tests]
    assert found == []
