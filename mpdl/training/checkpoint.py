"""Checkpoints of a training run: DIR/model.npz, DIR/optimizer.npz and DIR/state.json.

model.npz holds parameters and buffers by name; optimizer.npz the optimizer's per-parameter
arrays (`state/<index>/<name>`) and, as JSON in `meta`, its parameter groups and scalar state;
state.json the epoch, step, sampler and RNG state, the run's configuration and the SHA-256 of the
two archives. A save writes all three files into DIR/.staging first (each to a temporary name,
then renamed), then moves them into DIR, state.json last. A crash at any moment leaves one whole
checkpoint: while the staging files are written, DIR still holds the previous one; while they are
moved, the staging files that are left, over those of DIR, make up the new one. `load_checkpoint`
takes the newest whole set and reports a checkpoint that has none.

With `keep` > 0 a save also leaves a copy of the checkpoint it wrote in DIR/history/step-NNNNNNNN
(hard links where the filesystem allows), and deletes all but the newest `keep` of those.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from mpdl.fileio import write_atomic

FILES = ("model.npz", "optimizer.npz", "state.json")
#: where a save writes the new files before moving them into the checkpoint directory
STAGING = ".staging"
#: where a save with keep > 0 leaves copies of the checkpoints it wrote
HISTORY = "history"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not match the run."""


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
                    optimizer_state_dict: dict[str, Any], state: dict[str, Any],
                    keep: int = 0) -> None:
    """Write the three files of a checkpoint into directory (created if needed), so that a crash
    at any moment leaves either the previous checkpoint or this one loadable; with `keep` > 0,
    also keep a copy in directory/history (the newest `keep` copies stay)."""
    directory = Path(directory)
    staging = directory / STAGING
    directory.mkdir(parents=True, exist_ok=True)
    _finish_interrupted_save(directory)
    staging.mkdir(exist_ok=True)
    model_bytes = _npz_bytes(model_state)
    optim_bytes = _npz_bytes(optimizer_arrays(optimizer_state_dict))
    state = {**state, "sha256": {"model.npz": hashlib.sha256(model_bytes).hexdigest(),
                                 "optimizer.npz": hashlib.sha256(optim_bytes).hexdigest()}}
    contents = (model_bytes, optim_bytes, (json.dumps(state, indent=1) + "\n").encode())
    for name, data in zip(FILES, contents, strict=True):
        write_atomic(staging / name, data, durable=True)
    _sync_directory(staging)
    for name in FILES:  # state.json last
        os.replace(staging / name, directory / name)
    _sync_directory(directory)
    staging.rmdir()
    if keep > 0:
        _keep_copy(directory, int(state.get("step", 0)), keep)


def _keep_copy(directory: Path, step: int, keep: int) -> None:
    """Copy the checkpoint in directory to directory/history/step-NNNNNNNN (through staging, so
    that a copy that is there is whole), then delete all but the newest `keep` copies."""
    history = directory / HISTORY
    target = history / f"step-{step:08d}"
    partial = history / f".step-{step:08d}.partial"
    history.mkdir(exist_ok=True)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    for name in FILES:
        try:
            os.link(directory / name, partial / name)
        except OSError:
            shutil.copyfile(directory / name, partial / name)
    if target.exists():
        shutil.rmtree(target)
    os.replace(partial, target)
    for old in sorted(p for p in history.iterdir() if p.name.startswith("step-"))[:-keep]:
        shutil.rmtree(old)


def _finish_interrupted_save(directory: Path) -> None:
    """Complete the moves of a save that stopped while moving its files (its staging state.json is
    still there), then drop what an earlier save left in staging."""
    staging = directory / STAGING
    if not staging.is_dir():
        return
    if (staging / "state.json").is_file():
        for name in FILES:
            if (staging / name).is_file():
                os.replace(staging / name, directory / name)
    for leftover in staging.iterdir():
        leftover.unlink()


def _sync_directory(path: Path) -> None:
    """Make the renames inside path durable (where the platform lets a directory be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def module_rngs(model: Any) -> dict[str, Any]:
    """The state of every random generator of model's modules (dropout), by module name."""
    return {name: module.rng.bit_generator.state for name, module in model.named_modules()
            if isinstance(getattr(module, "rng", None), np.random.Generator)}


def restore_rngs(model: Any, saved: dict[str, Any]) -> None:
    """Put back what `module_rngs` returned."""
    for name, module in model.named_modules():
        rng = getattr(module, "rng", None)
        if isinstance(rng, np.random.Generator) and name in saved:
            rng.bit_generator.state = saved[name]


def has_checkpoint(directory: str | Path) -> bool:
    directory = Path(directory)
    return (directory / "state.json").is_file() or (directory / STAGING / "state.json").is_file()


def _read_set(paths: dict[str, Path]) -> tuple[dict[str, Any], dict[str, bytes]] | str:
    """(state, archive bytes) of one set of the three files, or why it is not a whole checkpoint."""
    missing = [name for name, path in paths.items() if not path.is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        state = json.loads(paths["state.json"].read_text())
        blobs = {name: paths[name].read_bytes() for name in FILES[:2]}
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    for name, blob in blobs.items():
        if hashlib.sha256(blob).hexdigest() != state.get("sha256", {}).get(name):
            return f"{name} does not match state.json"
    return state, blobs


def load_checkpoint(directory: str | Path
                    ) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state_dict, run state) from directory: the newest whole set of
    files (see the module docstring); CheckpointError when there is none."""
    directory = Path(directory)
    staging = directory / STAGING
    committed = {name: directory / name for name in FILES}
    moving = {name: staging / name if (staging / name).is_file() else directory / name
              for name in FILES}
    reasons = []
    for paths in ((moving, committed) if (staging / "state.json").is_file() else (committed,)):
        found = _read_set(paths)
        if not isinstance(found, str):
            break
        reasons.append(found)
    else:
        if all(r.startswith("missing") for r in reasons):
            raise CheckpointError(f"{directory}: not a checkpoint ({reasons[-1]})")
        raise CheckpointError(f"{directory}: no whole checkpoint ({'; '.join(reasons)})")
    state, blobs = found
    with np.load(io.BytesIO(blobs["model.npz"]), allow_pickle=False) as archive:
        model = {k: archive[k] for k in archive.files}
    with np.load(io.BytesIO(blobs["optimizer.npz"]), allow_pickle=False) as archive:
        optim = optimizer_state({k: archive[k] for k in archive.files})
    return model, optim, state
