"""`mpdl export`: a GPT checkpoint of `mpdl train --model gpt` as a safetensors file under nanoGPT's
names (`mpdl.training.nanogpt`), for PyTorch, nanoGPT and the tools that read safetensors.

    mpdl export --checkpoint DIR OUT.safetensors

The checkpoint may come from any training layout (whole, sharded ZeRO, per stage); `mpdl train
--init-from OUT.safetensors` starts a run from the file.
"""

from __future__ import annotations

import argparse

from mpdl.cli import UsageError
from mpdl.cli.output import is_rank0
from mpdl.training.checkpoint import CheckpointError, load_checkpoint
from mpdl.training.nanogpt import export_state


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "example: mpdl export --checkpoint ckpt model.safetensors"
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="the --checkpoint DIR of a `mpdl train --model gpt` run (any layout)")
    p.add_argument("out", metavar="OUT.safetensors", help="the file to write")


def run(args: argparse.Namespace) -> int:
    try:
        model_state, _, state = load_checkpoint(args.checkpoint)
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint: {exc}") from None
    info = state.get("model_info")
    if not info or info.get("name") != "gpt":
        model = state.get("config", {}).get("model", "?")
        raise UsageError(f"--checkpoint: {args.checkpoint}: not a GPT checkpoint (written by mpdl "
                         f"train --model {model})")
    if is_rank0():
        try:
            export_state(model_state, info, args.out)
        except OSError as exc:
            raise UsageError(f"OUT.safetensors: cannot write {args.out} ({exc})") from None
        print(f"wrote {args.out}: {len(model_state)} tensors under nanoGPT's names, "
              f"{sum(v.size for v in model_state.values()):,} parameters")
    return 0
