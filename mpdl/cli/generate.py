"""`mpdl generate`: sample text from the GPT checkpoint of a `mpdl train --model gpt` run.

    mpdl generate --checkpoint DIR [--prompt TEXT] [--max-new-tokens N] [--temperature T]
                  [--top-k K] [--seed S]

One process is enough; under mpiexec every rank checks the flags and the checkpoint, and rank 0
samples and prints. An addition model writes its answers reversed (123+456= then 9750).
"""

from __future__ import annotations

import argparse

from mpdl.cli import UsageError
from mpdl.cli.output import is_rank0
from mpdl.training.checkpoint import CheckpointError
from mpdl.training.generation import check_prompt, default_prompt, load_gpt, sample


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("example: mpdl generate --checkpoint ckpt --prompt '123+456=' --max-new-tokens 4 "
                "--top-k 1")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="the --checkpoint DIR of a `mpdl train --model gpt` run")
    p.add_argument("--prompt", metavar="TEXT",
                   help="the text to continue, in the model's vocabulary (default: a newline, or "
                        "the vocabulary's first character when it has none)")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="characters to sample (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="divides the logits: below 1 sharper, above 1 flatter (default: "
                        "%(default)s)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="sample among the K most likely characters only (1: greedy; default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens: expected a number >= 0, got {args.max_new_tokens}")
    if not args.temperature > 0:
        raise UsageError(f"--temperature: expected a positive number, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k: expected a positive number, got {args.top_k}")
    try:
        model, info = load_gpt(args.checkpoint)
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint: {exc}") from None
    prompt = default_prompt(info["vocab"]) if args.prompt is None else args.prompt
    try:
        check_prompt(info["vocab"], prompt)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None
    if is_rank0():
        print(sample(model, info["vocab"], prompt, args.max_new_tokens, args.temperature,
                     args.top_k, args.seed))
    return 0
