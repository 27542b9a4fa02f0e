"""Checkpoints of a training run: DIR/model.npz, DIR/optimizer.npz and DIR/state.json, or, for a
strategy that shards the model (ZeRO), one DIR/shard-RRRRR.npz per shard and DIR/state.json.

model.npz holds parameters and buffers by name; optimizer.npz the optimizer's per-parameter arrays
(`state/<index>/<name>`) and, as JSON in `meta`, its parameter groups and scalar state; state.json
the epoch, step, sampler and RNG state, the run's configuration, the SHA-256 of the two archives
and, under "checksum", the SHA-256 of its own canonical form (`canonical_sha256`), so that a
state.json changed by hand or by a bad disk is refused, and so is one without a checksum (written
before checksums, or with its key deleted) unless the caller accepts it once (`accept_unchecked`;
`add_checksum` then writes the checksum in). A save writes all three files into DIR/.staging first
(each to a temporary name, then renamed), then moves them into DIR, state.json last. A crash at any
moment leaves one whole checkpoint: while the staging files are written, DIR still holds the
previous one; while they are moved, the staging files that are left, over those of DIR, make up the
new one. `load_checkpoint` takes the newest whole set and reports a checkpoint that has none.

With `keep` > 0 a save also leaves a copy of the checkpoint it wrote in DIR/history/step-NNNNNNNN
(hard links where the filesystem allows), and deletes all but the newest `keep` of those.

A sharded checkpoint (`save_sharded_checkpoint`, called on every rank) is the same kind of set:
each rank that holds a shard writes its file into DIR/.staging, then rank 0 writes state.json,
which holds the SHA-256 of every shard file and the manifest of the layout (the units, their
parameters, offsets and dtypes, and how many ranks shared them), and moves the set into DIR,
state.json last. `load_checkpoint` reassembles whole tensors from the shards, so the run that
resumes may have any number of ranks and any strategy. A pipeline or tensor-parallel run writes
the same kind of set, one part per stage and tensor-parallel shard (with ZeRO-1, per dp rank
too): each array with the runs of the whole tensor's elements it holds (`assemble_parts`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpdl.backend import bfloat16_dtype
from mpdl.fileio import describe_write_error, write_atomic

FILES = ("model.npz", "optimizer.npz", "state.json")
#: where a save writes the new files before moving them into the checkpoint directory
STAGING = ".staging"
#: where a save with keep > 0 leaves copies of the checkpoints it wrote
HISTORY = "history"


#: the key of state.json that holds the SHA-256 of the rest of it
CHECKSUM = "checksum"
#: the train flag that accepts a state.json without a checksum once
ACCEPT_UNCHECKED = "--accept-unchecked-checkpoint"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not match the run."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, a read-only path): one line naming the
    error, the path and the bytes it needed. The previous checkpoint stays."""

    #: `mpdl train`'s exit status for it, which `mpdl launch` does not retry
    exit_status = 4


def canonical_sha256(state: dict[str, Any]) -> str:
    """The SHA-256 of state as JSON (its "checksum" left out) with sorted keys and no spaces, after
    a round trip through JSON (so that tuples and lists, int and str keys compare alike)."""
    body = json.loads(json.dumps({k: v for k, v in state.items() if k != CHECKSUM}))
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def state_bytes(state: dict[str, Any]) -> bytes:
    """state.json's contents: state with its canonical checksum."""
    return (json.dumps({**state, CHECKSUM: canonical_sha256(state)}, indent=1) + "\n").encode()


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
    model_bytes = _npz_bytes(model_state)
    optim_bytes = _npz_bytes(optimizer_arrays(optimizer_state_dict))
    state = {**state, "sha256": {"model.npz": hashlib.sha256(model_bytes).hexdigest(),
                                 "optimizer.npz": hashlib.sha256(optim_bytes).hexdigest()}}
    contents = (model_bytes, optim_bytes, state_bytes(state))
    at = directory
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _finish_interrupted_save(directory)
        staging.mkdir(exist_ok=True)
        for name, data in zip(FILES, contents, strict=True):
            at = staging / name
            write_atomic(at, data, durable=True)
        at = directory
        _commit(directory, FILES, int(state.get("step", 0)), keep)
    except OSError as exc:
        raise CheckpointWriteError(describe_write_error(
            exc, f"the checkpoint {directory}", sum(map(len, contents)), at)) from None


def _commit(directory: Path, names: Sequence[str], step: int, keep: int) -> None:
    """Move the staged files `names` into directory in order (state.json, the last, last), drop
    the files of an earlier checkpoint they do not replace, and keep a copy when keep > 0."""
    staging = directory / STAGING
    _sync_directory(staging)
    for name in names:
        os.replace(staging / name, directory / name)
    _drop_unreferenced(directory, names)
    _sync_directory(directory)
    staging.rmdir()
    if keep > 0:
        _keep_copy(directory, step, keep, names)


def _keep_copy(directory: Path, step: int, keep: int, names: Sequence[str]) -> None:
    """Copy the checkpoint in directory to directory/history/step-NNNNNNNN (through staging, so
    that a copy that is there is whole), then delete all but the newest `keep` copies."""
    history = directory / HISTORY
    target = history / f"step-{step:08d}"
    partial = history / f".step-{step:08d}.partial"
    history.mkdir(exist_ok=True)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    for name in names:
        try:
            os.link(directory / name, partial / name)
        except OSError:
            shutil.copyfile(directory / name, partial / name)
    if target.exists():
        shutil.rmtree(target)
    os.replace(partial, target)
    for old in sorted(p for p in history.iterdir() if p.name.startswith("step-"))[:-keep]:
        shutil.rmtree(old)


def save_sharded_checkpoint(directory: str | Path, comm: Any, shard: dict[str, np.ndarray] | None,
                            state: dict[str, Any], keep: int = 0) -> None:
    """Collective over comm: a rank with a `shard` writes DIR/shard-RANK.npz, rank 0 writes
    state.json (its `state`, which holds the manifest, plus every shard file's SHA-256) and moves
    the set into DIR as `save_checkpoint` does, so that a crash leaves one whole checkpoint."""
    directory = Path(directory)
    staging = directory / STAGING
    what = f"the checkpoint {directory}"

    def agreed_write(write: Callable[[], Any], nbytes: int, at: Path) -> Any:
        """write()'s result on this rank (writing at `at`); CheckpointWriteError on every rank
        when it failed on one (collective, so that no rank waits for one that stopped)."""
        result, error = None, None
        try:
            result = write()
        except OSError as exc:
            error = describe_write_error(exc, what, nbytes, at)
        everyone = comm.allgather_object((result, error))
        failed = next((e for _, e in everyone if e), None)
        if failed:
            raise CheckpointWriteError(failed)
        return [r for r, _ in everyone]

    def prepare() -> None:
        if comm.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            _finish_interrupted_save(directory)
            staging.mkdir(exist_ok=True)

    agreed_write(prepare, 0, directory)
    name, data = f"shard-{comm.rank:05d}.npz", b""

    def write_shard() -> tuple[str, str] | None:
        if shard is None:
            return None
        write_atomic(staging / name, data, durable=True)
        return name, hashlib.sha256(data).hexdigest()

    if shard is not None:
        data = _npz_bytes(shard)
    digests = [d for d in agreed_write(write_shard, len(data), staging / name) if d is not None]
    state = {**state, "sha256": dict(digests)}
    contents = state_bytes(state)

    def commit() -> None:
        if comm.rank == 0:
            write_atomic(staging / "state.json", contents, durable=True)
            _commit(directory, [n for n, _ in digests] + ["state.json"],
                    int(state.get("step", 0)), keep)

    agreed_write(commit, len(contents), staging / "state.json")


def _drop_unreferenced(directory: Path, names: Sequence[str]) -> None:
    """Remove the files of an earlier checkpoint of the other kind (or more shards) that the
    one just committed does not use."""
    for path in directory.iterdir():
        if path.is_file() and path.name not in names and (
                path.name.startswith("shard-") or path.name in FILES):
            path.unlink()


def _finish_interrupted_save(directory: Path) -> None:
    """Complete the moves of a save that stopped while moving its files (its staging state.json is
    still there), then drop what an earlier save left in staging."""
    staging = directory / STAGING
    if not staging.is_dir():
        return
    if (staging / "state.json").is_file():
        for name in sorted(f.name for f in staging.iterdir() if f.name != "state.json"):
            os.replace(staging / name, directory / name)
        os.replace(staging / "state.json", directory / "state.json")
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


def orphan_arrays(directory: str | Path) -> list[str]:
    """The archives of a checkpoint in directory whose state.json is gone (sorted names)."""
    directory = Path(directory)
    if has_checkpoint(directory) or not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir()
                  if p.is_file() and (p.name in FILES[:2] or p.name.startswith("shard-")))


#: what `load_checkpoint`'s run state must hold to resume a run
REQUIRED_KEYS = ("epoch", "step", "sampler")


def check_keys(directory: str | Path, state: dict[str, Any]) -> None:
    """CheckpointError naming state.json and the first of REQUIRED_KEYS it lacks."""
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"{Path(directory) / 'state.json'}: no {missing[0]!r} key; "
                              f"cannot resume from it")


def _read_set(state_path: Path, locate: Callable[[str], Path], accept_unchecked: bool
              ) -> tuple[dict[str, Any], dict[str, bytes]] | str:
    """(state, archive bytes) of the set whose state.json is at state_path (its archives are the
    files state.json has a SHA-256 of, found by `locate`), or why it is not a whole checkpoint."""
    if not state_path.is_file():
        missing = [n for n in FILES[:2] if not locate(n).is_file()]
        return f"missing {', '.join([*missing, 'state.json'])}"
    try:
        state = json.loads(state_path.read_text())
        if not isinstance(state, dict):
            return f"{state_path}: expected a JSON object"
        if CHECKSUM not in state and not accept_unchecked:
            return (f"{state_path}: it has no checksum (written before checksums, or its "
                    f"{CHECKSUM!r} key deleted); if it is an older checkpoint you trust, resume "
                    f"from it once with mpdl train --resume {ACCEPT_UNCHECKED} (that writes its "
                    f"checksum)")
        if CHECKSUM in state and state[CHECKSUM] != canonical_sha256(state):
            return (f"{state_path}: changed since it was written (its checksum does not match "
                    f"its contents: edited by hand or a bad disk)")
        names = list(state.get("sha256", {})) or list(FILES[:2])
        missing = [name for name in names if not locate(name).is_file()]
        if missing:
            return f"missing {', '.join(missing)}"
        blobs = {name: locate(name).read_bytes() for name in names}
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    for name, blob in blobs.items():
        if hashlib.sha256(blob).hexdigest() != state.get("sha256", {}).get(name):
            return f"{name} does not match state.json"
    return state, blobs


def load_checkpoint(directory: str | Path, accept_unchecked: bool = False
                    ) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state_dict, run state) from directory: the newest whole set of
    files (see the module docstring), whole tensors also from a sharded one; CheckpointError when
    there is none, or when its state.json has no checksum (unless `accept_unchecked`)."""
    directory = Path(directory)
    staging = directory / STAGING

    def moving(name: str) -> Path:
        return staging / name if (staging / name).is_file() else directory / name

    sets = [(directory / "state.json", lambda name: directory / name)]
    if (staging / "state.json").is_file():
        sets.insert(0, (staging / "state.json", moving))
    reasons = []
    for state_path, locate in sets:
        found = _read_set(state_path, locate, accept_unchecked)
        if not isinstance(found, str):
            break
        reasons.append(found)
    else:
        if all(r.startswith("missing") for r in reasons):
            raise CheckpointError(f"{directory}: not a checkpoint ({reasons[-1]})")
        changed = [r for r in reasons if "changed since it was written" in r
                   or "it has no checksum" in r]
        if changed:
            raise CheckpointError(f"refusing {changed[-1]}")
        raise CheckpointError(f"{directory}: no whole checkpoint ({'; '.join(reasons)})")
    state, blobs = found
    if "manifest" in state:
        model, optim = _assemble(state["manifest"], blobs)
        return model, optim, state
    with np.load(io.BytesIO(blobs["model.npz"]), allow_pickle=False) as archive:
        model = {k: _typed(archive[k]) for k in archive.files}
    with np.load(io.BytesIO(blobs["optimizer.npz"]), allow_pickle=False) as archive:
        optim = optimizer_state({k: _typed(archive[k]) for k in archive.files})
    return model, optim, state


def add_checksum(directory: str | Path) -> bool:
    """Write the checksum into directory's state.json when it has none (one accepted with
    `accept_unchecked`); whether it had none."""
    path = Path(directory) / "state.json"
    state = json.loads(path.read_text())
    if CHECKSUM in state:
        return False
    write_atomic(path, state_bytes(state), durable=True)
    return True


def _typed(a: np.ndarray) -> np.ndarray:
    """An array as read from an .npz: bfloat16 (which .npy stores as 2-byte void) gets its type
    back."""
    return a.view(bfloat16_dtype()) if a.dtype == np.dtype("V2") else a


def assemble_parts(manifest: dict[str, Any], blobs: dict[str, bytes]
                   ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Whole tensors (model state by name, a one-rank optimizer's state_dict) from the part files
    of a per-stage / per-shard checkpoint (format "parts": a pipeline's or tensor-parallel run's).
    Each file's `meta` lists its arrays: [target ("model" or "state"), parameter name or
    position, state key, whole shape, dtype]; array aN holds flat values, rN the (start, length)
    runs of the whole tensor's flat elements they fill. Every whole tensor must be filled."""
    model: dict[str, np.ndarray] = {}
    state: dict[str, dict[str, Any]] = {}
    filled: dict[tuple[str, str, Any], int] = {}
    for name in sorted(n for n in blobs if n.startswith("shard-")):
        with np.load(io.BytesIO(blobs[name]), allow_pickle=False) as archive:
            arrays = {k: _typed(archive[k]) for k in archive.files}
        for n, (target, key, entry, shape, dtype) in enumerate(json.loads(str(arrays["meta"]))):
            dest, slot = (model, key) if target == "model" else (state.setdefault(key, {}), entry)
            if slot not in dest:
                dest[slot] = np.empty(shape, dtype=dtype)
            whole, values, offset = dest[slot].reshape(-1), arrays[f"a{n}"], 0
            for start, length in arrays[f"r{n}"]:
                whole[start:start + length] = values[offset:offset + length]
                offset += length
            filled[(target, key, entry)] = filled.get((target, key, entry), 0) + offset
    for (target, key, entry), count in filled.items():
        size = (model[key] if target == "model" else state[key][entry]).size
        if count != size:
            raise CheckpointError(f"the parts fill {count} of the {size} elements of "
                                  f"{target} {key}{'' if entry is None else ' ' + entry}")
    for entries in state.values():
        entries.update(manifest["scalars"])
    return model, {"state": state, "param_groups": manifest["param_groups"]}


def _assemble(manifest: dict[str, Any], blobs: dict[str, bytes]
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Whole tensors (model state by name, a replica's optimizer state_dict) from the shard
    files of a sharded checkpoint. The manifest: `ranks` that shared the units; per unit its
    `dtype`, `count` and `params` ([name, position, shape, offset]); the optimizer's array
    `state_keys`, `scalars` and `param_groups`; the model's other arrays are in shard 0. A
    manifest of format "parts" goes to `assemble_parts`."""
    if manifest.get("format") == "parts":
        return assemble_parts(manifest, blobs)
    shards = []
    for rank in range(manifest["ranks"]):
        with np.load(io.BytesIO(blobs[f"shard-{rank:05d}.npz"]), allow_pickle=False) as a:
            shards.append({k: _typed(a[k]) for k in a.files})
    model: dict[str, np.ndarray] = {}
    state: dict[str, dict[str, Any]] = {}
    for i, unit in enumerate(manifest["units"]):
        flat = {key: np.concatenate([s[f"unit{i}/{key}"] for s in shards])
                for key in ["param", *(f"state/{k}" for k in manifest["state_keys"])]}
        for name, position, shape, offset in unit["params"]:
            size = int(np.prod(shape))
            model[name] = flat["param"][offset:offset + size].reshape(shape)
            if manifest["state_keys"]:
                state[str(position)] = {**manifest["scalars"], **{
                    k: flat[f"state/{k}"][offset:offset + size].reshape(shape)
                    for k in manifest["state_keys"]}}
    model.update({k[len("other/"):]: v for k, v in shards[0].items() if k.startswith("other/")})
    return model, {"state": state, "param_groups": manifest["param_groups"]}
