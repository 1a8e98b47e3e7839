"""``python -m meshtrain.convert from-hf --hf DIR --out DIR``, ``to-hf --from DIR --out DIR`` and ``to-peft``

``from-hf`` imports a Hugging Face checkpoint of a family with an HF adapter (``config.json`` + safetensors) into a
meshtrain parameter export (``DIR/params`` + ``DIR/meshtrain.json``, as ``python -m
meshtrain.export`` writes; fine-tune with ``checkpoint.init_from=DIR``, or skip this step with
``checkpoint.init_from=hf:HF_DIR``). ``to-hf`` writes a run directory, a step directory or an export
as an HF checkpoint that ``transformers``' ``from_pretrained`` loads (a ``train.lora`` run's adapters merged
into its weights). ``to-peft`` writes a ``train.lora`` run's adapters as a PEFT adapter directory
(``meshtrain.weights.peft``) that ``peft.PeftModel.from_pretrained`` loads onto the HF base.

Options::

    from-hf --hf DIR --out DIR [--host-devices N] [mesh.*=... sharding.preset=...]
    to-hf --from DIR --out DIR [--step N] [--dtype auto|float32|bfloat16|float16]
          [--max-shard-size 5GB] [--host-devices N] [mesh.*=... sharding.preset=...]
    to-peft --run DIR --out DIR [--step N] [--base NAME] [--host-devices N] [mesh.*=... sharding.preset=...]

The weights are read straight into the shardings of the mesh (default: ``fsdp`` over every
device) by ``meshtrain.weights.loading``. Bad input prints one ``error: field: what is wrong`` line and exits 2.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import sys

import jax

from meshtrain.cli import ArgumentParser, add_mesh_arguments, add_trust_plugin_argument, run
from meshtrain.config import model_dict
from meshtrain.data.files import write_file
from meshtrain.data.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, end_of_document_id, load_tokenizer
from meshtrain.errors import ConfigError, new_output, writable_directory
from meshtrain.parallel.rules import ShardingRules
from meshtrain.weights import hf, peft
from meshtrain.weights.export_format import save_params
from meshtrain.weights.loading import SourceKind, load_model, mesh_from_args, restore_run, source_kind
from jax.sharding import Mesh


def _new_dir(path: str, field: str = "--out") -> pathlib.Path:
    out = pathlib.Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(field, f"{path} exists and is not empty; choose a new directory")
    return writable_directory(out, field, create=False)  # a failed conversion leaves no --out behind


def _copy_side_files(source: pathlib.Path, out: pathlib.Path) -> list[str]:
    copied = []
    if source.is_dir() and jax.process_index() == 0:
        for name in hf.SIDE_FILES:
            if (source / name).is_file():
                out.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source / name, out / name)
                copied.append(name)
    return copied


def _tokenizer_config(out: pathlib.Path, copied: list[str]) -> list[str]:
    """A run's own tokenizer (a ``tokenizer.json`` without a ``tokenizer_config.json``) gets one naming its
    end-of-text token, the one ``prepare`` ends documents with when no ``--eos`` is given, so that
    transformers and lm-eval know where a text ends; none when the vocabulary holds no usual such token."""
    if TOKENIZER_FILE not in copied or TOKENIZER_CONFIG_FILE in copied or jax.process_index() != 0:
        return []
    try:
        eos, _ = end_of_document_id(load_tokenizer(out / TOKENIZER_FILE, "--from"), None, "--from")
    except ConfigError:
        return []
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
    write_file(out / TOKENIZER_CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())
    return [TOKENIZER_CONFIG_FILE]


def from_hf(hf_dir: str, out: str, mesh: Mesh, rules: ShardingRules) -> pathlib.Path:
    """Imports the HF checkpoint ``hf_dir`` into a meshtrain export at ``out``."""
    out_dir = _new_dir(out)
    if source_kind(hf_dir, field="--hf") is not SourceKind.HF:
        raise ConfigError("--hf", f"{hf_dir} has no {hf.CONFIG_FILE}; give a Hugging Face model directory")
    model = load_model(hf_dir, mesh, rules, field="--hf")
    meta = {"source": str(pathlib.Path(hf_dir).absolute()), "model": model_dict(model.cfg),
            "hf": {"config": model.hf_config, "dtypes": model.hf_dtypes}}
    with new_output(out_dir, "--out"):
        written = save_params(out_dir, model.params, meta)
        _copy_side_files(pathlib.Path(hf_dir), written)
    return written


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30}


def parse_size(text: str, field: str = "--max-shard-size") -> int:
    """``"5GB"`` -> 5_000_000_000 (B, KB, MB, GB, KiB, MiB, GiB; a bare number is bytes)."""
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(field, f"{text!r} is not a size; write e.g. 5GB, 500MB or 1048576")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def to_hf(source: str, out: str, mesh: Mesh, rules: ShardingRules, *, step: int | None = None,
          dtype: str = "auto", max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES,
          trust_plugin: bool = False) -> list[str]:
    """Writes the model at ``source`` (run, step directory, export or HF directory) as an HF
    checkpoint at ``out``. ``dtype`` ``auto`` keeps an import's own tensor dtypes, else float32.
    A ``model.plugin`` the source records is imported only with ``trust_plugin``."""
    if dtype != "auto" and dtype not in hf.DTYPES:
        raise ConfigError("--dtype", f"{dtype!r} is not valid; use auto or one of {list(hf.DTYPES)}")
    out_dir = _new_dir(out)
    model = load_model(source, mesh, rules, step=step, field="--from", trust_plugin=trust_plugin)
    if dtype == "auto":
        recorded = model.hf_dtypes or {}
        file_dtype = lambda name: recorded.get(name, "float32")
    else:
        file_dtype = dtype
    with new_output(out_dir, "--out"):
        written = hf.save(out_dir, model.cfg, model.params, dtype=file_dtype, base_config=model.hf_config,
                          max_shard_bytes=max_shard_bytes)
        copied = _copy_side_files(model.path, out_dir)
        return written + copied + _tokenizer_config(out_dir, copied)


def to_peft(run: str, out: str, mesh: Mesh, rules: ShardingRules, *, step: int | None = None,
            base_model: str | None = None, trust_plugin: bool = False) -> list[str]:
    """Writes the LoRA adapters of checkpoint ``step`` (default latest) of the run ``run`` as a PEFT
    adapter directory ``out``; ``base_model`` (default: the run's ``checkpoint.init_from``) is recorded
    as its ``base_model_name_or_path``."""
    out_dir = _new_dir(out)
    if source_kind(run, field="--run") is not SourceKind.RUN:
        raise ConfigError("--run", f"{run} is not a run directory; give the run.dir of a train.lora run")
    cfg, sharded, restored = restore_run(run, mesh, rules, step=step, field="--run", trust_plugin=trust_plugin)
    if sharded.lora is None:
        raise ConfigError("--run", f"{run} trained without train.lora (rank 0), so it has no adapter; write its "
                          "whole model with to-hf")
    base = base_model or (cfg.checkpoint.init_from or "").removeprefix(hf.INIT_PREFIX) or None
    with new_output(out_dir, "--out"):
        return peft.save_adapter(out_dir, sharded.lora, cfg.model, sharded.abstract_params, restored.state.adapters,
                                 base_model=base)


def _parse_args(argv: list[str] | None):
    parser = ArgumentParser(prog="python -m meshtrain.convert", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    importer = commands.add_parser("from-hf", help="HF checkpoint -> meshtrain export")
    importer.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    exporter = commands.add_parser("to-hf", help="meshtrain run or export -> HF checkpoint")
    exporter.add_argument("--from", dest="source", required=True,
                          help="run directory, step directory, export or HF directory")
    exporter.add_argument("--step", type=int, help="checkpoint step of a run (default: the latest)")
    exporter.add_argument("--dtype", default="auto", help="auto (an import's own dtypes, else float32), "
                          "float32, bfloat16 or float16")
    exporter.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    add_trust_plugin_argument(exporter)
    adapter = commands.add_parser("to-peft", help="a train.lora run's adapters -> PEFT adapter directory")
    adapter.add_argument("--run", required=True, help="run directory of a train.lora run")
    adapter.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    adapter.add_argument("--base", help="base_model_name_or_path to record (default: the run's checkpoint.init_from)")
    add_trust_plugin_argument(adapter)
    for command in (importer, exporter, adapter):
        command.add_argument("--out", required=True, help="new directory to write")
        add_mesh_arguments(command)
    return parser.parse_args(argv)


def _convert(argv: list[str] | None) -> None:
    args = _parse_args(argv)
    mesh, rules = mesh_from_args(args)
    if args.command == "from-hf":
        written = from_hf(args.hf, args.out, mesh, rules)
        message = (f"imported {args.hf} to {written}; fine-tune with checkpoint.init_from={written} "
                   f"(or checkpoint.init_from={hf.INIT_PREFIX}{args.hf})")
    elif args.command == "to-peft":
        files = to_peft(args.run, args.out, mesh, rules, step=args.step, base_model=args.base,
                        trust_plugin=args.trust_plugin)
        message = (f"wrote {args.out}: {', '.join(files)}; load it with "
                   f"peft.PeftModel.from_pretrained(base, {args.out!r})")
    else:
        files = to_hf(args.source, args.out, mesh, rules, step=args.step, dtype=args.dtype,
                      max_shard_bytes=parse_size(args.max_shard_size), trust_plugin=args.trust_plugin)
        message = f"wrote {args.out}: {', '.join(files)}"
    if jax.process_index() == 0:
        print(message, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    return run(_convert, argv)


if __name__ == "__main__":
    sys.exit(main())
