"""Checkpoints of a training run: DIR/model.npz, DIR/optimizer.npz and DIR/state.json.

model.npz holds parameters and buffers by name; optimizer.npz the optimizer's per-parameter
arrays (`state/<index>/<name>`) and, as JSON in `meta`, its parameter groups and scalar state;
state.json the epoch, step, sampler and RNG state, the run's configuration and the SHA-256 of the
two archives. Each file is written to a temporary name and moved into place with os.replace,
state.json last, so a crash never leaves a half-written file; a crash between the moves leaves
archives that do not match state.json, which `load_checkpoint` reports instead of loading.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

FILES = ("model.npz", "optimizer.npz", "state.json")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not match the run."""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def optimizer_arrays(state_dict: dict[str, Any]) -> dict[str, np.ndarray]:
    """An optimizer state_dict as named arrays (JSON for the non-array parts)."""
    arrays: dict[str, np.ndarray] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        for key, value in entries.items():
            if hasattr(value, "shape") and np.ndim(value) > 0:
                arrays[f"state/{index}/{key}"] = np.asarray(value)
            else:
                scalars.setdefault(str(index), {})[key] = value.item() if hasattr(value, "item") \
                    else value
    meta = {"param_groups": state_dict["param_groups"], "scalars": scalars}
    arrays["meta"] = np.array(json.dumps(meta))
    return arrays


def optimizer_state(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The inverse of `optimizer_arrays`."""
    meta = json.loads(str(arrays["meta"]))
    state: dict[str, dict[str, Any]] = {k: dict(v) for k, v in meta["scalars"].items()}
    for name, value in arrays.items():
        if name.startswith("state/"):
            _, index, key = name.split("/", 2)
            state.setdefault(index, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(directory: str | Path, model_state: dict[str, np.ndarray],
                    optimizer_state_dict: dict[str, Any], state: dict[str, Any]) -> None:
    """Write the three files of a checkpoint into directory (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_bytes = _npz_bytes(model_state)
    optim_bytes = _npz_bytes(optimizer_arrays(optimizer_state_dict))
    state = {**state, "sha256": {"model.npz": hashlib.sha256(model_bytes).hexdigest(),
                                 "optimizer.npz": hashlib.sha256(optim_bytes).hexdigest()}}
    _write_atomic(directory / "model.npz", model_bytes)
    _write_atomic(directory / "optimizer.npz", optim_bytes)
    _write_atomic(directory / "state.json", (json.dumps(state, indent=1) + "\n").encode())


def has_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / "state.json").is_file()


def load_checkpoint(directory: str | Path
                    ) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state_dict, run state) from directory; CheckpointError when a
    file is missing, unreadable or does not match state.json."""
    directory = Path(directory)
    missing = [name for name in FILES if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"{directory}: not a checkpoint (missing {', '.join(missing)})")
    try:
        state = json.loads((directory / "state.json").read_text())
        blobs = {name: (directory / name).read_bytes() for name in FILES[:2]}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{directory}: unreadable checkpoint ({exc})") from None
    for name, blob in blobs.items():
        if hashlib.sha256(blob).hexdigest() != state.get("sha256", {}).get(name):
            raise CheckpointError(f"{directory}: {name} does not match state.json (a write was "
                                  f"interrupted)")
    with np.load(io.BytesIO(blobs["model.npz"]), allow_pickle=False) as archive:
        model = {k: archive[k] for k in archive.files}
    with np.load(io.BytesIO(blobs["optimizer.npz"]), allow_pickle=False) as archive:
        optim = optimizer_state({k: archive[k] for k in archive.files})
    return model, optim, state
