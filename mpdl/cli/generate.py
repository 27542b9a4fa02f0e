"""`mpdl generate`: generate text from the GPT checkpoint of a `mpdl train --model gpt` run.

    mpiexec -n P mpdl generate --checkpoint DIR [--prompt TEXT | --prompts FILE]
                  [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]
                  [--tp T] [--pp S] [--dp D] [--microbatches M] [--json OUT] [--metrics]

The prompts (one per line of FILE) run as one batch with a KV cache (`mpdl.inference.inference`),
on a dp × pp × tp grid of the ranks (`mpdl.inference.serving`): data parallel splits the prompts,
pipeline parallel streams micro-batches of them through the stages, tensor parallel splits each
block's heads and MLP. The checkpoint may come from any training layout. Rank 0 prints each
prompt's text on a line of its own; with --prompts or --metrics, then a table of time to first
token, per-token latency and tokens/s per rank and in total; --json OUT writes one JSON line per
prompt and a last line of the run's figures. An addition model reads a problem (123+456=,
shorter operands zero-padded to its digits), stops after the answer and prints it beside the
reversed sum it writes: 123+456=9750 then "# = 579".
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from mpdl.cli import UsageError
from mpdl.cli.output import write_json_lines
from mpdl.cli.train import limit_blas_threads
from mpdl.comm import as_communicator
from mpdl.inference.generation import (
    addition_answer,
    addition_digits,
    addition_example,
    addition_prompt,
    check_prompt,
    default_prompt,
    load_gpt,
)
from mpdl.inference.serving import check_layout, serve, summary
from mpdl.training.checkpoint import CheckpointError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("example: mpiexec -n 2 mpdl generate --checkpoint ckpt --prompts prompts.txt "
                "--max-new-tokens 4 --top-k 1 --tp 2 --json out.jsonl")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="the --checkpoint DIR of a `mpdl train --model gpt` run (any layout)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", metavar="TEXT",
                      help="the text to continue, in the model's vocabulary (default: a newline, "
                           "or the vocabulary's first character when it has none); for an "
                           "addition model a problem such as 123+456=")
    what.add_argument("--prompts", metavar="FILE",
                      help="a file of prompts, one per line, generated as one batch")
    p.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="characters to generate after each prompt (default: the model's block "
                        "size, the characters it sees at once: past them it no longer sees the "
                        "prompt; for an addition model the answer's digits + 1)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="divides the logits: below 1 sharper, above 1 flatter (default: "
                        "%(default)s)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="sample among the K most likely characters only (1: greedy; default: all)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; prompt i draws from its own generator (seed, i) "
                        "(default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor-parallel ranks per stage; must divide the heads (default: 1)")
    p.add_argument("--pp", type=int, default=1, metavar="S",
                   help="pipeline stages, at most the blocks (default: 1)")
    p.add_argument("--dp", type=int, metavar="D",
                   help="data-parallel replicas, each generating its share of the prompts "
                        "(default: the ranks / (pp·tp))")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="micro-batches of prompts per replica streamed through the stages "
                        "(default: pp)")
    p.add_argument("--json", metavar="OUT",
                   help="write one JSON line per prompt (text, tokens, time to first token, "
                        "tokens/s, latency) and a last line of the run's figures")
    p.add_argument("--metrics", action="store_true",
                   help="print the table of timings after the texts (always with --prompts)")


def ready_to_serve(comm: Any, model: Any, args: argparse.Namespace) -> tuple[int, int, int]:
    """The (dp, pp, tp) layout of --dp/--pp/--tp over the world, checked against the model (a
    UsageError if it does not fit), with the model in evaluation mode and BLAS on one thread."""
    try:
        layout = check_layout(comm.size, model.n_head, model.n_layer, args.dp, args.pp, args.tp)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    limit_blas_threads()
    model.eval()
    return layout


def read_prompts(path: str, vocab: str, digits: int | None = None) -> list[str]:
    """The prompts of a file, one per line (for an addition model of `digits`, its problems
    zero-padded); ValueError naming --prompts for a file that cannot be read or is empty, an
    empty line, a character outside the vocabulary or a line that is not a problem."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompts: cannot read {path} ({exc})") from None
    if not lines:
        raise ValueError(f"--prompts: {path} holds no prompts (expected one per line)")
    for n, line in enumerate(lines, 1):
        try:
            lines[n - 1] = model_prompt(vocab, line, digits)
        except ValueError as exc:
            raise ValueError(f"--prompts: {path} line {n}: {str(exc).removeprefix('prompt: ')}"
                             ) from None
    return lines


def model_prompt(vocab: str, prompt: str, digits: int | None) -> str:
    """`prompt` as the model reads it (an addition problem zero-padded); ValueError naming the
    prompt when `check_prompt` or `addition_prompt` refuses it."""
    check_prompt(vocab, prompt)
    return prompt if digits is None else addition_prompt(prompt, digits)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens: expected a number >= 0, got {args.max_new_tokens}")
    if not args.temperature > 0:
        raise UsageError(f"--temperature: expected a positive number, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k: expected a positive number, got {args.top_k}")
    if args.microbatches is not None and args.microbatches < 1:
        raise UsageError(f"--microbatches: expected a positive number, got {args.microbatches}")
    try:
        model, info = load_gpt(args.checkpoint)
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint: {exc}") from None
    vocab, digits = info["vocab"], addition_digits(info)
    if args.max_new_tokens is None:
        args.max_new_tokens = info["block_size"] if digits is None else digits + 1
    try:
        if args.prompts is not None:
            texts = read_prompts(args.prompts, vocab, digits)
        elif args.prompt is None and digits is not None:
            raise ValueError(f"prompt: give the problem this addition model answers: "
                             f"{addition_example(digits)}")
        else:
            texts = [model_prompt(vocab, default_prompt(vocab) if args.prompt is None
                                  else args.prompt, digits)]
    except ValueError as exc:
        message = str(exc)
        raise UsageError(message if message.startswith("--") else f"--{message}") from None
    comm = as_communicator(None)
    dp, pp, tp = ready_to_serve(comm, model, args)
    prompts = [[vocab.index(ch) for ch in text] for text in texts]
    sequences, figures = serve(comm, model, prompts, args.max_new_tokens, dp, pp, tp,
                               args.temperature, args.top_k, args.seed, args.microbatches)
    if comm.rank != 0:
        return 0
    for s in sequences:
        text = "".join(vocab[i] for i in s.tokens)
        print(text if digits is None else f"{text}  {answer_note(text, texts[s.index], digits)}")
    totals = summary(sequences, figures)
    layout = {"dp": dp, "pp": pp, "tp": tp, "microbatches": args.microbatches or pp}
    if args.prompts is not None or args.metrics:
        print(metrics_table(totals, figures, layout, args.max_new_tokens), end="", flush=True)
    if args.json:
        rows: list[dict[str, Any]] = [prompt_row(s, texts[s.index], vocab, digits)
                                      for s in sequences]
        rows.append({"summary": True, **layout, **totals,
                     "ranks": [{"rank": f.rank, "dpt": list(f.coords), "prompts": f.prompts,
                                "new_tokens": f.new_tokens, "wall_s": f.wall_s,
                                "tokens_per_s": f.tokens_per_s} for f in figures]})
        write_json_lines(os.fspath(args.json), rows)
    return 0


def answer_note(text: str, prompt: str, digits: int) -> str:
    """What an addition model's text says: the sum it wrote reversed, read the usual way."""
    answer = addition_answer(text[len(prompt):], digits)
    if answer is None:
        return f"# no answer: the {digits + 1} characters after '=' are not all digits"
    return f"# = {answer} (the sum is written reversed, least significant digit first)"


def prompt_row(s: Any, prompt: str, vocab: str, digits: int | None = None) -> dict[str, Any]:
    """One prompt's JSON line (with an addition model's `answer`, read the usual way)."""
    gaps = s.latencies_s
    p50, p99 = (float(v) for v in np.percentile(gaps, [50, 99])) if gaps else (None, None)
    text = "".join(vocab[i] for i in s.tokens)
    row = {"index": s.index, "prompt": prompt, "text": text,
           "tokens": s.new_tokens, "new_tokens": len(s.new_tokens),
           "ttft_s": s.ttft_s if s.token_times else None, "tokens_per_s": s.tokens_per_s,
           "latency_p50_s": p50, "latency_p99_s": p99}
    if digits is not None:
        row["answer"] = addition_answer(text[len(prompt):], digits)
    return row


def metrics_table(totals: dict[str, Any], figures: list[Any], layout: dict[str, int],
                  max_new_tokens: int) -> str:
    """The timings as '#' comment lines: one row per rank, then the totals."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.2f} ms"

    lines = [f"# {totals['prompts']} prompts, {max_new_tokens} new tokens each, dp {layout['dp']}"
             f" x pp {layout['pp']} x tp {layout['tp']}, {layout['microbatches']} micro-batches",
             f"# {'rank':>5} {'(d,p,t)':>9} {'prompts':>8} {'new tokens':>11} {'wall s':>9} "
             f"{'tokens/s':>10}"]
    for f in figures:
        coords = "(" + ",".join(map(str, f.coords)) + ")"
        lines.append(f"# {f.rank:>5} {coords:>9} {f.prompts:>8} {f.new_tokens:>11} "
                     f"{f.wall_s:>9.3f} {f.tokens_per_s:>10.1f}")
    lines.append(f"# total {totals['new_tokens']} new tokens in {totals['wall_s']:.3f} s: "
                 f"{totals['tokens_per_s']:.1f} tokens/s; time to first token p50 "
                 f"{ms(totals['ttft_p50_s'])}, max {ms(totals['ttft_max_s'])}; per-token latency "
                 f"p50 {ms(totals['latency_p50_s'])}, p99 {ms(totals['latency_p99_s'])}")
    return "\n".join(lines) + "\n"
