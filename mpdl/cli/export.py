"""`mpdl export`: a GPT checkpoint of `mpdl train --model gpt` as a safetensors file under nanoGPT's
names (`mpdl.models.nanogpt`), for PyTorch, nanoGPT and the tools that read safetensors, or as a
Hugging Face transformers directory (`mpdl.training.hf`: GPT-2 config, weights and a character
tokenizer).

    mpdl export --checkpoint DIR OUT.safetensors
    mpdl export --checkpoint DIR --format hf OUT_DIR

The checkpoint may come from any training layout (whole, sharded ZeRO, per stage); `mpdl train
--init-from OUT` starts a run from either.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from safetensors import SafetensorError

from mpdl.cli import UsageError
from mpdl.cli.output import is_rank0
from mpdl.inference.generation import gpt_checkpoint
from mpdl.models.nanogpt import export_state
from mpdl.training.checkpoint import CheckpointError
from mpdl.training.hf import export_hf


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("examples: mpdl export --checkpoint ckpt model.safetensors; "
                "mpdl export --checkpoint ckpt --format hf hf-model")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="the --checkpoint DIR of a `mpdl train --model gpt` run (any layout)")
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one file under nanoGPT's names; hf: a directory that "
                        "transformers' AutoModelForCausalLM and AutoTokenizer load "
                        "(default: %(default)s)")
    p.add_argument("out", metavar="OUT",
                   help="the file (safetensors) or directory (hf) to write")


def run(args: argparse.Namespace) -> int:
    try:
        model_state, info = gpt_checkpoint(args.checkpoint)
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint: {exc}") from None
    out = Path(args.out)
    if not out.absolute().parent.is_dir():
        raise UsageError(f"OUT: {args.out}: the folder {out.absolute().parent} does not exist")
    if is_rank0():
        hf = args.format == "hf"
        try:
            (export_hf if hf else export_state)(model_state, info, args.out)
        except (OSError, SafetensorError) as exc:
            raise UsageError(f"OUT: cannot write {args.out} ({exc})") from None
        readable(out)
        names = "transformers' GPT-2 names, with a character tokenizer" if hf else "nanoGPT's names"
        print(f"wrote {args.out}: {len(model_state)} tensors under {names}, "
              f"{sum(v.size for v in model_state.values()):,} parameters")
    return 0


def readable(out: Path) -> None:
    """Give the written file (or the directory's files) the mode the umask allows a new file
    (0644 under umask 022): safetensors writes through a private temporary file (0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [out] if out.is_file() else [p for p in out.rglob("*") if p.is_file()]:
        os.chmod(path, 0o666 & ~mask)
