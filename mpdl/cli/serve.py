"""`mpdl serve`: a GPT checkpoint of `mpdl train --model gpt` behind an OpenAI-compatible HTTP API.

    mpiexec -n P mpdl serve --checkpoint DIR [--tp T] [--pp S] [--dp D] [--host 127.0.0.1] --port P
                 [--page-size N] [--kv-pages N] [--max-batch N] [--token-budget N] [--max-tokens N]

The ranks form dp replicas of pp stages of tp ranks (`mpdl.inference.serving`'s grid); the first
rank of replica d listens on port P + d (`mpdl.inference.server`) and every rank of the replica
runs the continuous-batching engine (`mpdl.inference.engine`) over the pages of its stage's blocks
and its heads (`mpdl.inference.paged`). It runs until interrupted (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import math
import signal
import threading
from pathlib import Path

from mpdl.cli import UsageError
from mpdl.cli.generate import ready_to_serve
from mpdl.comm import as_communicator
from mpdl.inference.engine import replica_engine
from mpdl.inference.generation import load_gpt
from mpdl.inference.server import MAX_TOKENS
from mpdl.training.checkpoint import CheckpointError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "example: mpiexec -n 2 mpdl serve --checkpoint ckpt --tp 2 --port 8000"
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="the --checkpoint DIR of a `mpdl train --model gpt` run (any layout)")
    p.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor-parallel ranks per replica; must divide the heads (default: 1)")
    p.add_argument("--pp", type=int, default=1, metavar="S",
                   help="pipeline stages per replica, at most the blocks (default: 1)")
    p.add_argument("--dp", type=int, metavar="D",
                   help="replicas, replica d on port P + d (default: the ranks / (pp·tp))")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, required=True, metavar="P", help="port of the first replica")
    p.add_argument("--page-size", type=int, default=16, metavar="N",
                   help="positions per KV-cache page (default: %(default)s)")
    p.add_argument("--kv-pages", type=int, metavar="N",
                   help="KV-cache pages per replica, at least a block's worth (default: a "
                        "whole block for every sequence of --max-batch)")
    p.add_argument("--max-batch", type=int, default=64, metavar="N",
                   help="sequences running at once (default: %(default)s)")
    p.add_argument("--token-budget", type=int, default=512, metavar="N",
                   help="tokens one step runs: a decode token per running sequence, the rest for "
                        "prompts (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, metavar="N",
                   help="the most tokens one request may ask for (max_tokens); above it, 400 "
                        "(default: %(default)s)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="static: admit only into an empty batch (a baseline to measure against)")
    p.add_argument("--kv", choices=("paged", "contiguous"), default="paged",
                   help="contiguous: each sequence takes a whole block of pages at once (a "
                        "baseline to measure against)")


def run(args: argparse.Namespace) -> int:
    for flag in ("page_size", "kv_pages", "max_batch", "token_budget", "max_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: expected a positive number, got {value}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port: expected 1..65535, got {args.port}")
    try:
        import starlette  # noqa: F401, PLC0415 (the serve extra)
        import uvicorn  # noqa: F401, PLC0415

        from mpdl.inference import server  # noqa: PLC0415
    except ImportError as exc:
        raise UsageError(f"serve needs the serve extra: pip install 'mpdl[serve]' ({exc})") from None
    try:
        model, info = load_gpt(args.checkpoint)
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint: {exc}") from None
    comm = as_communicator(None)
    dp, pp, tp = ready_to_serve(comm, model, args)
    block_pages = math.ceil(model.block_size / args.page_size)
    if args.kv_pages is not None and args.kv_pages < block_pages:
        raise UsageError(f"--kv-pages: expected at least a block's worth, {block_pages} pages of "
                         f"{args.page_size} positions for the block of {model.block_size}, got "
                         f"{args.kv_pages}")
    pages = args.kv_pages or args.max_batch * block_pages
    engine, group, grid = replica_engine(
        comm, model, info["vocab"], dp, pp, tp, args.page_size, pages, max_batch=args.max_batch,
        token_budget=args.token_budget, static=args.batching == "static",
        contiguous=args.kv == "contiguous")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    frontend = http = failed = None
    port = args.port + grid.d
    if grid.t == 0 and grid.p == 0:
        frontend = server.Frontend(engine, Path(args.checkpoint).resolve().name,
                                   args.max_tokens)
        try:
            http = server.start_http(frontend, args.host, port)
        except RuntimeError as exc:
            failed = str(exc)
    failures = [f for f in comm.allgather_object(failed) if f]
    if failures:  # every rank stops, not only the one that could not listen
        raise UsageError(failures[0])
    if http is not None:
        print(f"mpdl serve: replica {grid.d} on http://{args.host}:{port} (pp {pp} x tp {tp}, {pages} "
              f"KV pages of {args.page_size} positions)", flush=True)
    server.run_replica(engine, group, frontend, stop)
    if http is not None:
        frontend.running = False
        http.should_exit = True
    return 0
