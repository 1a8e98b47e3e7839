"""Throughput of ``prepare`` beside the ``tokenizers`` library's own batch encoding of the same text.

    python scripts/bench_prepare.py [--input GLOB ...] [--tokenizer TOK | --vocab-size 16384]
        [--repeat 3]

The input defaults to the vim manual (``/usr/share/vim/vim*/doc/*.txt``, English prose) when it is
installed, else the Python standard library's top-level ``*.py``. Without ``--tokenizer`` a byte-level
BPE of ``--vocab-size`` ids is trained on that input first (its time is printed, not counted). Then,
``--repeat`` times in turn, best of each kept:

* ceiling: ``encode_batch_fast`` (what prepare calls) and ``encode_batch`` over the documents
  already in memory, in prepare's 4 MB batches: tokenization alone, on all cores;
* prepare: ``meshtrain.data.corpus.prepare`` into a temporary directory (reading, tokenizing,
  writing and fsyncing shards, index), progress bar off.

MB/s are of the documents' UTF-8 text; the last line is prepare's share of the ceiling.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import sysconfig
import tempfile
import time

from meshtrain.data.corpus import BATCH_TEXT_BYTES, DocumentReader, input_files, prepare
from meshtrain.data.tokenizer import load_tokenizer, train_bpe

_MB = 1e6


def _default_inputs() -> list[str]:
    vim_docs = sorted(glob.glob("/usr/share/vim/vim*/doc"))
    return [f"{vim_docs[-1]}/*.txt"] if vim_docs else [os.path.join(sysconfig.get_paths()["stdlib"], "*.py")]


def _batches(documents: list[str]) -> list[list[str]]:
    """The documents in batches of about BATCH_TEXT_BYTES, as prepare makes them."""
    batches, batch, size = [], [], 0
    for document in documents:
        batch.append(document)
        size += len(document.encode())
        if size >= BATCH_TEXT_BYTES:
            batches.append(batch)
            batch, size = [], 0
    return batches + ([batch] if batch else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", action="append", help="globs of text or .jsonl files (repeatable)")
    parser.add_argument("--tokenizer", help="tokenizer.json (default: train a BPE on the input)")
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    inputs = args.input or _default_inputs()

    files = input_files(inputs, "--input")
    reader = DocumentReader(files, "text", "--input", lambda line: print(line, file=sys.stderr))
    documents = [text for text, _ in reader]
    text_mb = sum(len(document.encode()) for document in documents) / _MB
    print(f"input: {', '.join(inputs)}: {len(files)} files, {len(documents)} documents, {text_mb:.1f} MB of text; "
          f"{os.cpu_count()} CPUs, TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}")
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as scratch:
        tokenizer_path = args.tokenizer
        if tokenizer_path is None:
            start = time.perf_counter()
            tokenizer_path = str(train_bpe(documents, args.vocab_size, os.path.join(scratch, "tokenizer")))
            print(f"trained a BPE of {args.vocab_size} ids in {time.perf_counter() - start:.1f} s")
        tokenizer = load_tokenizer(tokenizer_path, "--tokenizer")
        tokenizer.encode_special_tokens = True  # as prepare encodes
        batches = _batches(documents)
        best = {"encode_batch_fast": float("inf"), "encode_batch": float("inf"), "prepare": float("inf")}
        for _ in range(args.repeat):
            for name in ("encode_batch_fast", "encode_batch"):
                encode = getattr(tokenizer, name)
                start = time.perf_counter()
                tokens = sum(len(encoding.ids)  # reading the ids, as prepare must, is counted
                             for batch in batches for encoding in encode(batch, add_special_tokens=False))
                best[name] = min(best[name], time.perf_counter() - start)
            out = os.path.join(scratch, "prepared")
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            prepare(inputs, tokenizer_path, out, progress=False)
            best["prepare"] = min(best["prepare"], time.perf_counter() - start)
    print(f"{tokens:,} tokens ({tokens / (text_mb * _MB):.3f} tokens/byte); best of {args.repeat}:")
    for name, seconds in best.items():
        print(f"  {name:<18} {seconds:6.2f} s  {text_mb / seconds:6.2f} MB/s")
    print(f"prepare / encode_batch_fast ceiling: {best['encode_batch_fast'] / best['prepare']:.2f}")


if __name__ == "__main__":
    main()
