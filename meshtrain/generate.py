"""``python -m meshtrain.generate --run RUN_DIR (or --hf DIR) --prompt "..." [--chat [--system "..."]]``

Greedy (``--temperature 0``, the default) or temperature sampling with a KV cache, enough to
sanity-check a model. Tokenizer (``--tokenizer``): ``auto`` uses the ``tokenizer.json`` of the model's
directory (a run directory records the one its data was tokenized with; an export and an HF
directory carry theirs), else UTF-8 bytes as ids 0..255 for a model trained on ``data.source=text``,
and refuses any other model (its ids are not bytes); ``bytes`` forces byte ids; or a path to a
``tokenizer.json``.
Prints the prompt followed by the generated text. With ``--chat`` the prompt is a user message (after
``--system``'s) rendered by the chat template ``prepare-sft`` uses with that tokenizer (the
tokenizer directory's ``chat_template.jinja`` or ``tokenizer_config.json``'s, else the built-in one;
``--chat-template FILE`` names another), and only the reply is printed. Bad input prints one
``error: field: what is wrong`` line and exits 2.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
from collections.abc import Callable

import jax
import numpy as np

from meshtrain import jsonio
from meshtrain.cli import ArgumentParser, add_mesh_arguments, add_trust_plugin_argument, run
from meshtrain.data.sft import chat_prompt
from meshtrain.data.tokenizer import TOKENIZER_FILE
from meshtrain.errors import ConfigError
from meshtrain.sampling import ByteTokenizer, HFTokenizer, Tokenizer, generate_tokens
from meshtrain.weights.loading import LoadedModel, load_model, mesh_from_args
from models.api import CachedDecoder, family_of


def _eos_id(model_dir: pathlib.Path, hf_config: dict | None) -> int | None:
    """The end-of-sequence id from generation_config.json or config.json (the first of a list)."""
    sources = []
    if (model_dir / "generation_config.json").is_file():
        try:
            sources.append(jsonio.loads((model_dir / "generation_config.json").read_text()))
        except ValueError:
            pass
    sources.append(hf_config or {})
    for source in sources:
        eos = source.get("eos_token_id")
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if isinstance(eos, int):
            return eos
    return None


def make_tokenizer(choice: str, model: LoadedModel) -> Tokenizer:
    """The tokenizer ``--tokenizer`` names for ``model`` (see the module docstring)."""
    model_dir = model.home or (model.path if model.path.is_dir() else model.path.parent)
    if choice == "auto":
        if (model_dir / TOKENIZER_FILE).is_file():
            choice = str(model_dir / TOKENIZER_FILE)
        elif model.trained_on_bytes:
            choice = "bytes"
        else:
            learned = ("was not trained on bytes (data.source=text)" if model.trained_on_bytes is False
                       else "does not say it was trained on bytes")
            raise ConfigError("--tokenizer", f"{model_dir} holds no {TOKENIZER_FILE} and {learned}, so byte ids "
                              "would be wrong; give --tokenizer PATH/tokenizer.json (or bytes to force them)")
    if choice == "bytes":
        if model.cfg.vocab_size < 256:
            raise ConfigError("--tokenizer", f"bytes need a vocabulary of at least 256, but the model has "
                              f"{model.cfg.vocab_size}; give a tokenizer.json")
        return ByteTokenizer()
    path = pathlib.Path(choice)
    if not path.is_file():
        raise ConfigError("--tokenizer", f"no such file: {choice}; use auto, bytes or a tokenizer.json path")
    return HFTokenizer(path, eos_id=_eos_id(model_dir, model.hf_config))


def generate_text(model: LoadedModel, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, *,
                  temperature: float = 0.0, seed: int = 0) -> str:
    """The text ``model`` continues ``prompt`` with (up to the end-of-sequence token)."""
    return continue_ids(model, tokenizer, tokenizer.encode(prompt), max_new_tokens, temperature=temperature,
                        seed=seed)


def chat_reply(model: LoadedModel, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, *,
               system: str | None = None, template_path: str | None = None, temperature: float = 0.0,
               seed: int = 0) -> str:
    """The assistant's reply of ``model`` to the user message ``prompt`` (after ``system``), the
    conversation rendered by the chat template ``prepare-sft`` uses with this tokenizer
    (``meshtrain.data.sft.chat_prompt``), up to the end-of-document token that ends a reply there."""
    if not isinstance(tokenizer, HFTokenizer):
        raise ConfigError("--chat", "renders a chat template, which needs a tokenizer.json (--tokenizer), not "
                          "byte ids")
    messages = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": prompt}]
    ids, eos_id = chat_prompt(str(tokenizer.path), messages, template_path)
    return continue_ids(model, dataclasses.replace(tokenizer, eos_id=eos_id), ids, max_new_tokens,
                        temperature=temperature, seed=seed)


def continue_ids(model: LoadedModel, tokenizer: Tokenizer, ids: list[int], max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int = 0) -> str:
    """The text ``model`` continues the tokens ``ids`` with (up to ``tokenizer.eos_id``)."""
    if not isinstance(model.module(), CachedDecoder):
        raise ConfigError("--run", f"model family {family_of(model.cfg).name!r} has no KV-cache path "
                          "(init_cache / cached_forward); generation needs one")
    if not ids:
        raise ConfigError("--prompt", "encodes to no tokens; give a non-empty prompt")
    if max(ids) >= model.cfg.vocab_size:
        raise ConfigError("--tokenizer", f"gives id {max(ids)}, outside the model's vocabulary "
                          f"[0, {model.cfg.vocab_size})")
    rows = model.rules.data_parallel_size(model.mesh.shape)  # the batch is split that many ways
    new = generate_tokens(model.graphdef, model.params, np.asarray([ids] * rows), max_new_tokens,
                          temperature=temperature, seed=seed, stop_id=tokenizer.eos_id, shard=model.shard)[0]
    new = list(new)
    if tokenizer.eos_id is not None and tokenizer.eos_id in new:
        new = new[:new.index(tokenizer.eos_id)]
    return tokenizer.decode(new)


def _parse_args(argv: list[str] | None):
    parser = ArgumentParser(prog="python -m meshtrain.generate", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="meshtrain run directory, step directory or export")
    source.add_argument("--hf", help="Hugging Face model directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tokenizer", default="auto", help="auto, bytes or a tokenizer.json path")
    parser.add_argument("--step", type=int, help="checkpoint step of a run (default: the latest)")
    parser.add_argument("--chat", action="store_true",
                        help="send --prompt as a user message through the chat template prepare-sft renders with "
                             "(the tokenizer directory's chat_template.jinja or tokenizer_config.json's, else the "
                             "built-in one) and print the reply")
    parser.add_argument("--system", help="with --chat: a system message before the prompt")
    parser.add_argument("--chat-template", help="with --chat: a Jinja chat template file to render with instead")
    add_mesh_arguments(parser)
    add_trust_plugin_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, print_fn: Callable[[str], None] = print) -> int:

    def generate(argv: list[str] | None) -> None:
        args = _parse_args(argv)
        if args.max_new_tokens < 1:
            raise ConfigError("--max-new-tokens", f"must be a positive integer, got {args.max_new_tokens}")
        if not 0 <= args.seed < 2 ** 32:
            raise ConfigError("--seed", f"must be an integer in [0, 2**32), got {args.seed}")
        if not (math.isfinite(args.temperature) and args.temperature >= 0):
            raise ConfigError("--temperature", f"must be a finite number >= 0 (0 = greedy), got {args.temperature}")
        if not args.chat and (args.system is not None or args.chat_template is not None):
            raise ConfigError("--system" if args.system is not None else "--chat-template", "applies to --chat only")
        mesh, rules = mesh_from_args(args)
        model = load_model(args.run or args.hf, mesh, rules, step=args.step,
                           field="--run" if args.run else "--hf", trust_plugin=args.trust_plugin)
        tokenizer = make_tokenizer(args.tokenizer, model)
        if args.chat:
            reply = chat_reply(model, tokenizer, args.prompt, args.max_new_tokens, system=args.system,
                               template_path=args.chat_template, temperature=args.temperature, seed=args.seed)
            if jax.process_index() == 0:
                print_fn(reply)
            return
        text = generate_text(model, tokenizer, args.prompt, args.max_new_tokens,
                             temperature=args.temperature, seed=args.seed)
        if jax.process_index() == 0:
            print_fn(args.prompt + text)

    return run(generate, argv)


if __name__ == "__main__":
    sys.exit(main())
