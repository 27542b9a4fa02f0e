"""A GPT checkpoint as a Hugging Face transformers model directory, and back.

    OUT_DIR/config.json              GPT2Config (model_type gpt2, activation gelu: the exact erf
                                     GELU mpdl's blocks use, tied embeddings)
    OUT_DIR/model.safetensors        GPT2LMHeadModel's names (transformer.h.N.attn.c_attn ...)
    OUT_DIR/tokenizer.json           a character tokenizer: one token per character, ids in the
                                     vocabulary's order, decoded by joining the characters
    OUT_DIR/tokenizer_config.json    PreTrainedTokenizerFast over tokenizer.json
    OUT_DIR/generation_config.json   no end-of-text token: generation stops at max_new_tokens

`AutoModelForCausalLM.from_pretrained(OUT_DIR)` and `AutoTokenizer.from_pretrained(OUT_DIR)` load
it. GPT-2 keeps its four projections in `Conv1D` modules, whose weights are (in_features,
out_features), the transpose of mpdl's and nanoGPT's `Linear`: those four are transposed on the
way out and back; every other tensor travels unchanged (`mpdl.models.nanogpt` names them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mpdl.models.nanogpt import import_state, nanogpt_name, state_from

#: the GPT-2 modules that are Conv1D (weights stored in × out)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _transposed(name: str) -> bool:
    return name.startswith("transformer.h.") and name.split(".", 3)[3] in CONV1D


def gpt2_config(info: dict[str, Any]) -> dict[str, Any]:
    """The GPT2Config (as config.json's dict) of a checkpoint's `model_info`."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": len(info["vocab"]), "n_positions": info["block_size"],
            "n_embd": info["n_embd"], "n_layer": info["n_layer"], "n_head": info["n_head"],
            "n_inner": 4 * info["n_embd"], "activation_function": "gelu",
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "tie_word_embeddings": True, "bos_token_id": None,
            "eos_token_id": None, "pad_token_id": None,
            "torch_dtype": str(np.dtype(info["dtype"])) if "dtype" in info else "float32"}


def write_tokenizer(vocab: str, directory: Path, block_size: int) -> None:
    """tokenizer.json and tokenizer_config.json of a character tokenizer over `vocab`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    tok = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(vocab)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": block_size}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_hf(model_state: dict[str, np.ndarray], info: dict[str, Any],
              directory: str | Path) -> None:
    """Write a GPT's `model_state` (mpdl's names) and its `model_info` (vocab, block_size,
    n_layer, n_head, n_embd) as a transformers GPT-2 directory."""
    from safetensors.numpy import save_file  # noqa: PLC0415 (only export and import need it)

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in model_state.items():
        key = nanogpt_name(name)
        tensors[key] = np.ascontiguousarray(value.T if _transposed(key) else value)
    save_file(tensors, str(out / "model.safetensors"),
              metadata={"format": "pt", "vocab": json.dumps(info["vocab"])})
    (out / "config.json").write_text(json.dumps(gpt2_config(info), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}) + "\n")
    write_tokenizer(info["vocab"], out, info["block_size"])


def is_hf_dir(path: str | Path) -> bool:
    """Whether `path` is a directory holding a transformers model (config.json and
    model.safetensors)."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and (p / "model.safetensors").is_file()


def read_vocab(directory: str | Path) -> str:
    """The character vocabulary of an exported directory's tokenizer.json (ids in order);
    ValueError when it has none or it is not a character tokenizer."""
    path = Path(directory) / "tokenizer.json"
    try:
        model = json.loads(path.read_text(encoding="utf-8"))["model"]
        ids = model["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: no readable tokenizer vocabulary ({exc})") from None
    chars = sorted(ids, key=ids.get)
    if any(len(ch) != 1 for ch in chars) or sorted(ids.values()) != list(range(len(chars))):
        raise ValueError(f"{path}: not a character tokenizer (ids 0..n-1, one character each)")
    return "".join(chars)


def load_hf_tensors(directory: str | Path) -> tuple[dict[str, np.ndarray], str | None]:
    """The tensors of an exported directory under nanoGPT's names and layout (Conv1D weights
    transposed back) and its vocabulary (None without tokenizer.json); ValueError naming the
    file that cannot be read."""
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.numpy import load_file  # noqa: PLC0415

    path = Path(directory) / "model.safetensors"
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    tensors = {k: (np.ascontiguousarray(v.T) if _transposed(k) else v) for k, v in tensors.items()}
    vocab = read_vocab(directory) if (Path(directory) / "tokenizer.json").is_file() else None
    return tensors, vocab


def import_hf(directory: str | Path, model: Any, vocab: str | None = None) -> dict[str, np.ndarray]:
    """The state (mpdl's names, the model's dtype) for `model` (a GPT) from an exported
    directory; ValueError naming the file and the first tensor that is missing or has another
    shape, or a tokenizer whose vocabulary `vocab` differs from."""
    tensors, written = load_hf_tensors(directory)
    return state_from(tensors, Path(directory) / "model.safetensors", model, written, vocab)


def import_weights(path: str | Path, model: Any, vocab: str | None = None) -> dict[str, np.ndarray]:
    """The state for `model` from a safetensors file under nanoGPT's names or from an exported
    transformers directory (`import_hf`)."""
    return (import_hf if is_hf_dir(path) else import_state)(path, model, vocab)
