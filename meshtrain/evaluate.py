"""``python -m meshtrain.evaluate --run DIR | --model DIR --tasks T[,T...] [--include-path DIR] [--limit N]
[--batch-size B] [--out FILE.json] [--host-devices N] [mesh.*=...]``

Scores a run (its latest checkpoint, or ``--step``), a meshtrain export or an HF directory on
lm-evaluation-harness tasks (lm-eval's own, or YAML tasks under ``--include-path``) through
``meshtrain.harness.MeshtrainLM`` on the mesh (default ``fsdp`` over every device); prints
lm-eval's table and writes its results (without the per-document samples) to ``--out``. The text
is encoded by the ``tokenizer.json`` of the model's directory (a run records its data's) or
``--tokenizer``. Needs lm-eval (``pip install -e '.[harness]'``). Bad input prints one
``error: field: what is wrong`` line and exits 2.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from collections.abc import Callable

import jax

from meshtrain.cli import ArgumentParser, add_mesh_arguments, add_trust_plugin_argument, output_file, run
from meshtrain.data.tokenizer import TOKENIZER_FILE
from meshtrain.errors import ConfigError
from meshtrain.weights.loading import SourceKind, load_model, mesh_from_args, source_kind


def _parse_args(argv: list[str] | None):
    parser = ArgumentParser(prog="python -m meshtrain.evaluate", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="run directory or one of its step directories")
    source.add_argument("--model", help="meshtrain export (python -m meshtrain.export) or HF directory")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", default="", help="a directory of lm-eval YAML tasks to add")
    parser.add_argument("--limit", type=float, help="at most this many documents per task (a fraction if < 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward (rounded up to the "
                        "data-parallel size; default 8)")
    parser.add_argument("--out", help="JSON file to write lm-eval's results to")
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: the model directory's)")
    parser.add_argument("--step", type=int, help="with --run: the checkpoint step (default: the latest)")
    add_mesh_arguments(parser)
    add_trust_plugin_argument(parser)
    return parser.parse_args(argv)


def _check(args) -> None:
    """The flags that need no file read: one line naming the first bad one."""
    if args.limit is not None and not (math.isfinite(args.limit) and args.limit > 0
                                       and (args.limit < 1 or args.limit.is_integer())):
        raise ConfigError("--limit", f"must be a whole number of documents >= 1 or a fraction in (0, 1), "
                          f"got {args.limit}")
    if args.batch_size < 1:
        raise ConfigError("--batch-size", f"must be a positive integer, got {args.batch_size}")
    if args.step is not None and args.run is None:
        raise ConfigError("--step", "applies to --run only")
    if args.out is not None:
        output_file(args.out, ".json")


def main(argv: list[str] | None = None, print_fn: Callable[[str], None] = print) -> int:

    def evaluate(argv: list[str] | None) -> None:
        args = _parse_args(argv)
        _check(args)
        field = "--run" if args.run else "--model"
        path = args.run or args.model
        kind = source_kind(path, field=field)
        if (kind is SourceKind.RUN) != (field == "--run"):
            raise ConfigError(field, f"{path} is {'a run' if kind is SourceKind.RUN else 'an export or HF directory'}; "
                              f"use {'--run' if kind is SourceKind.RUN else '--model'}")
        try:
            from meshtrain import harness
        except ImportError as err:
            raise ConfigError("--tasks", f"lm-evaluation-harness is not installed ({err.msg}): pip install -e "
                              "'.[harness]'") from None
        tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
        manager = harness.task_manager(args.include_path, field="--include-path")
        harness.check_tasks(manager, tasks, field="--tasks")
        mesh, rules = mesh_from_args(args)
        model = load_model(path, mesh, rules, step=args.step, field=field, trust_plugin=args.trust_plugin)
        tokenizer_path = pathlib.Path(args.tokenizer) if args.tokenizer else model.home / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise ConfigError("--tokenizer" if args.tokenizer else field, f"no such file: {tokenizer_path}; the "
                              "tasks are text: give the model's tokenizer.json with --tokenizer")
        tokenizer = harness.TextTokenizer(tokenizer_path, model.hf_config, field="--tokenizer")
        lm = harness.MeshtrainLM(model.graphdef, model.params, model.mesh, model.rules, tokenizer,
                                 max_length=model.cfg.seq_len, batch_size=args.batch_size)
        limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
        results = harness.evaluate_tasks(lm, tasks, manager, limit=limit)
        if jax.process_index() != 0:
            return
        from lm_eval.utils import handle_non_serializable, make_table

        print_fn(make_table(results))
        if results.get("groups"):
            print_fn(make_table(results, "groups"))
        if args.out is not None:
            pathlib.Path(args.out).write_text(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
            print(f"wrote lm-eval's results to {args.out}", file=sys.stderr)

    return run(evaluate, argv)


if __name__ == "__main__":
    sys.exit(main())
