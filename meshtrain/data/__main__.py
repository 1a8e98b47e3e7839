"""``python -m meshtrain.data prepare ...``, ``prepare-sft ...`` and ``train-tokenizer ...``

``prepare`` tokenizes text files (one document each), ``.jsonl`` files (one document a line) and
parquet files, Arrow files and ``datasets`` ``save_to_disk`` directories (one document a row:
``meshtrain.data.columnar``) with a Hugging Face tokenizer into a prepared directory of token shards (see
``meshtrain.data.corpus`` and docs/data.md) and prints one summary line per split.
``prepare-sft`` does the same for supervised fine-tuning: JSON lines of prompt/response pairs or
chat messages, rendered with the tokenizer's chat template, with a loss mask that is 1 on the
response tokens only (``meshtrain.data.sft``; docs/sft.md).
``train-tokenizer`` trains a byte-level BPE on the same kind of input and prints the path of the
``tokenizer.json`` it wrote; when the input held too few repeated pairs for ``--vocab-size`` tokens,
one ``warning:`` line on stderr says how many it has.

Options::

    prepare --tokenizer TOK --input GLOB [--input GLOB ...] --out DIR
            [--val-fraction F | --val-input GLOB ...] [--text-field text] [--eos TOKEN]
            [--shard-tokens N] [--overwrite] [--no-progress]
    prepare-sft --tokenizer TOK --input GLOB [--input GLOB ...] --out DIR
            [--val-fraction F | --val-input GLOB ...] [--chat-template FILE] [--eos TOKEN]
            [--shard-tokens N] [--overwrite] [--no-progress]
    train-tokenizer --input GLOB [--input GLOB ...] --vocab-size N --out DIR [--text-field text]
            [--overwrite]

Globs are quoted so that the shell leaves them alone (``--input 'data/**/*.jsonl'``). Bad input
prints one ``error: field: what is wrong`` line and exits 2.
"""

from __future__ import annotations

import sys

from rich.console import Console

from meshtrain.cli import ArgumentParser, run
from meshtrain.data.corpus import DEFAULT_SHARD_TOKENS, DocumentReader, input_files, prepare
from meshtrain.data.sft import prepare_sft
from meshtrain.data.tokenizer import load_tokenizer, train_bpe, train_bpe_cuts, vocabulary_shortfall

_MB = 1e6


def _parse_args(argv: list[str] | None):
    parser = ArgumentParser(prog="python -m meshtrain.data", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    preparer = commands.add_parser("prepare", help="text -> prepared directory of token shards")
    sft = commands.add_parser("prepare-sft", help="prompt/response or chat jsonl -> prepared directory with a "
                              "loss mask on the responses")
    sft.add_argument("--chat-template", metavar="FILE",
                     help="a Jinja chat template (default: the tokenizer's, else the built-in one)")
    for command, unit in ((preparer, "document"), (sft, "example")):
        command.add_argument("--tokenizer", required=True, help="tokenizer.json, or a directory holding one")
        command.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                             help=f"every 1/F-th {unit} goes to the val split (0 <= F < 1)")
        command.add_argument("--val-input", action="append", default=[], metavar="GLOB",
                             help="files of the val split instead (repeatable)")
        command.add_argument("--eos", help="end-of-document token (default: the first of the usual ones)")
        command.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                             help=f"a shard closes once it holds N tokens (default {DEFAULT_SHARD_TOKENS})")
        command.add_argument("--no-progress", action="store_true", help="no progress bar")
    trainer = commands.add_parser("train-tokenizer", help="text -> byte-level BPE tokenizer.json")
    trainer.add_argument("--vocab-size", type=int, required=True, metavar="N")
    for command, replaced in ((preparer, "an already prepared --out"), (sft, "an already prepared --out"),
                              (trainer, "--out's tokenizer.json")):
        command.add_argument("--overwrite", action="store_true", help=f"replace {replaced}")
        command.add_argument("--input", action="append", required=True, metavar="GLOB",
                             help=("JSON lines files (repeatable; ** is recursive)" if command is sft
                                   else "text, .jsonl, .parquet or .arrow files, or save_to_disk directories "
                                   "(repeatable; ** is recursive)"))
        command.add_argument("--out", required=True, help="directory to write")
        if command is not sft:
            command.add_argument("--text-field", default="text",
                                 help="field of a .jsonl line, or column of a parquet/Arrow file, holding its text")
    args = parser.parse_args(argv)
    if args.overrides:
        parser.error(f"unexpected arguments: {' '.join(args.overrides)}")
    return args


def _summary(out: str, name: str, documents: int, tokens: int, text_bytes: int, seconds: float) -> str:
    return (f"{out} {name}: {documents:,} documents, {tokens:,} tokens, {text_bytes / _MB:.2f} MB of text, "
            f"{tokens / text_bytes:.3f} tokens/byte, {seconds:.1f} s, {text_bytes / _MB / max(seconds, 1e-9):.1f} MB/s")


def _data(argv: list[str] | None) -> None:
    args = _parse_args(argv)
    if args.command == "prepare":
        report = prepare(args.input, args.tokenizer, args.out, val_fraction=args.val_fraction,
                         val_inputs=args.val_input, text_field=args.text_field, eos=args.eos,
                         shard_tokens=args.shard_tokens, overwrite=args.overwrite, progress=not args.no_progress)
        for name, split in report.corpus.splits.items():
            print(_summary(args.out, name, split.num_documents, split.num_tokens, split.text_bytes,
                           report.seconds[name]))
    elif args.command == "prepare-sft":
        report = prepare_sft(args.input, args.tokenizer, args.out, val_fraction=args.val_fraction,
                             val_inputs=args.val_input, chat_template=args.chat_template, eos=args.eos,
                             shard_tokens=args.shard_tokens, overwrite=args.overwrite, progress=not args.no_progress)
        for name, counts in report.counts.items():
            print(f"{args.out} {name}: {counts.examples:,} examples, {counts.assistant_turns:,} assistant turns, "
                  f"{counts.tokens:,} tokens, {counts.loss_tokens:,} of them trained on "
                  f"({counts.loss_tokens / counts.tokens:.1%}); chat template: {report.template_source}")
        print(f"{args.out}: checked, then written, in {report.seconds:.1f} s")
    else:
        console = Console(stderr=True, soft_wrap=True, highlight=False)
        reader = DocumentReader(input_files(args.input, "--input"), args.text_field, "--input",
                                lambda line: console.print(line, markup=False))
        pieces = (piece for piece, _, _ in reader.pieces(train_bpe_cuts()))  # long documents cut, never whole
        written = train_bpe(pieces, args.vocab_size, args.out, overwrite=args.overwrite)
        short = vocabulary_shortfall(load_tokenizer(written, "--out").get_vocab_size(), args.vocab_size)
        if short:
            print(f"warning: {short}", file=sys.stderr, flush=True)
        print(written)


def main(argv: list[str] | None = None) -> int:
    return run(_data, argv)


if __name__ == "__main__":
    sys.exit(main())
