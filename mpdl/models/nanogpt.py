"""The GPT's weights under nanoGPT's names in a safetensors file, and back.

nanoGPT (Karpathy's `model.py`) names a GPT's tensors

    transformer.wte.weight, transformer.wpe.weight, transformer.ln_f.weight / .bias,
    transformer.h.N.ln_1, .attn.c_attn, .attn.c_proj, .ln_2, .mlp.c_fc, .mlp.c_proj (.weight, .bias)

and holds its Linear weights as (out_features, in_features), the layout of mpdl's `nn.Linear`
too, so the arrays travel unchanged. Its `lm_head.weight` is the same tensor as
`transformer.wte.weight` (tied) and is not written: loading `transformer.wte.weight` sets both
(in PyTorch, `load_state_dict(..., strict=False)`). The file's metadata holds the model's
configuration under nanoGPT's `GPTConfig` names (`config`, JSON: block_size, vocab_size, n_layer,
n_head, n_embd, dropout, bias) and, for a character model, its vocabulary (`vocab`, JSON).
The file is written and read with the `safetensors` library's NumPy API.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

#: mpdl's name of each of a block's tensors -> nanoGPT's (under blocks.N / transformer.h.N)
BLOCK_NAMES = {"ln1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
               "ln2": "ln_2", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


def nanogpt_name(name: str) -> str:
    """nanoGPT's name of the mpdl GPT parameter `name`; ValueError for one a GPT does not have."""
    top = {"token_embedding.weight": "transformer.wte.weight",
           "position_embedding.weight": "transformer.wpe.weight",
           "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
    if name in top:
        return top[name]
    parts = name.split(".")
    if parts[0] == "blocks" and len(parts) >= 4:
        module, leaf = ".".join(parts[2:-1]), parts[-1]
        if module in BLOCK_NAMES and leaf in ("weight", "bias"):
            return f"transformer.h.{parts[1]}.{BLOCK_NAMES[module]}.{leaf}"
    raise ValueError(f"{name}: not a parameter of mpdl's GPT")


def export_state(model_state: dict[str, np.ndarray], info: dict[str, Any],
                 path: str | Path) -> None:
    """Write a GPT's `model_state` (mpdl's names) to `path` under nanoGPT's names, with its
    `model_info` (a checkpoint's: vocab, block_size, n_layer, n_head, n_embd) as metadata."""
    from safetensors.numpy import save_file  # noqa: PLC0415 (only export and import need it)

    tensors = {nanogpt_name(k): np.ascontiguousarray(v) for k, v in model_state.items()}
    config = {"block_size": info["block_size"], "vocab_size": len(info["vocab"]),
              "n_layer": info["n_layer"], "n_head": info["n_head"], "n_embd": info["n_embd"],
              "dropout": 0.0, "bias": True}
    save_file(tensors, str(path), metadata={"config": json.dumps(config),
                                            "vocab": json.dumps(info["vocab"])})


def import_state(path: str | Path, model: Any, vocab: str | None = None
                 ) -> dict[str, np.ndarray]:
    """The state (mpdl's names, the model's dtype) for `model` (a GPT) from the nanoGPT-named
    file at `path`; ValueError naming the file and the first tensor that is missing or has
    another shape, or a vocabulary the file's metadata gives and `vocab` differs from."""
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415
    from safetensors.numpy import load_file  # noqa: PLC0415

    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    written = json.loads(metadata["vocab"]) if "vocab" in metadata else None
    return state_from(tensors, path, model, written, vocab)


def state_from(tensors: dict[str, np.ndarray], path: str | Path, model: Any,
               written_vocab: str | None, vocab: str | None) -> dict[str, np.ndarray]:
    """The state (mpdl's names, the model's dtype) for `model` from nanoGPT-named, nanoGPT-laid
    `tensors` read from `path`; ValueError naming `path` and the first tensor that is missing or
    has another shape, or a vocabulary `written_vocab` that `vocab` differs from."""
    if vocab is not None and written_vocab is not None and written_vocab != vocab:
        raise ValueError(f"{path}: written for the vocabulary {written_vocab!r}, this run's is "
                         f"{vocab!r}")
    params = dict(model.named_parameters())
    names = {nanogpt_name(name): name for name in params}
    extra = sorted(set(tensors) - set(names) - {"lm_head.weight"}
                   - {k for k in tensors if k.endswith((".attn.bias", ".attn.masked_bias"))})  # causal masks
    if extra:
        raise ValueError(f"{path}: {extra[0]} is not a tensor of this run's model "
                         f"({len(model.blocks)} blocks)")
    state = {}
    for key, name in names.items():
        want = params[name]
        if key not in tensors:
            raise ValueError(f"{path}: has no {key} (this run's model has {len(model.blocks)} "
                             f"blocks)")
        if tuple(tensors[key].shape) != tuple(want.shape):
            raise ValueError(f"{path}: {key} has shape {tuple(tensors[key].shape)}, this run's "
                             f"model needs {tuple(want.shape)}")
        state[name] = tensors[key].astype(want.dtype, copy=False)
    return state
