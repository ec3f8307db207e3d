"""Atomic checkpoints and ``resume=auto``.

One checkpoint is one folder under the checkpoint root::

    <root>/
      step_00000012/                 complete: renamed into place after everything was fsynced
        actor.safetensors            one file per named tensor dict (weights of a role, ...)
        critic.safetensors
        state.pt                     non-tensor state via torch.save: optimizer states, RNG
                                     states, data position, KL controller, Lagrange multiplier
        meta.json                    written last: step, and every file with its byte size
      .tmp-step_00000015-<pid>-<id>/ a save in progress (or killed): never read
      .old-step_00000012-<id>/       a replaced checkpoint on its way out: never read

Save = write every file into a ``.tmp-`` folder, fsync each file, write ``meta.json``, fsync
it and the folder, rename the folder to ``step_N`` (atomic on POSIX), fsync the root.  A crash
at any point leaves either the previous complete checkpoints untouched or the new one complete.
:func:`latest_complete` only considers ``step_N`` folders whose ``meta.json`` lists files that
all exist with the recorded sizes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from typing import Any

import torch
from safetensors.torch import load_file, save_file

META = "meta.json"
STATE = "state.pt"
FORMAT = 1
_STEP_RE = re.compile(r"step_(\d+)$")
_TMP_RE = re.compile(r"\.tmp-step_\d+-(\d+)-[0-9a-f]+$")
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+$")


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_partial(root: str) -> list[str]:
    """Delete ``.old-`` folders and ``.tmp-`` folders of processes that no longer run.

    Returns:
        The removed paths.
    """
    removed = []
    if not os.path.isdir(root):
        return removed
    for name in os.listdir(root):
        m = _TMP_RE.match(name)
        stale_tmp = m is not None and int(m.group(1)) != os.getpid() and not _pid_alive(
            int(m.group(1)))
        if stale_tmp or name.startswith(".old-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    return removed


def _standalone(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors writes only contiguous tensors that own their whole storage: copy views
    (e.g. parameters inside a flat buffer, tied weights), pass the rest through."""
    out, seen = {}, set()
    for k, v in named.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"tensor {k!r} is a {type(v).__name__}, not a torch.Tensor")
        t = v.detach().cpu()
        storage = t.untyped_storage()
        if (not t.is_contiguous() or t.storage_offset() or storage.nbytes() != t.nbytes
                or storage.data_ptr() in seen):
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out


def save_checkpoint(root: str, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                    state: dict[str, Any], keep_last: int = 0) -> str:
    """Write checkpoint ``step`` atomically (see the module docstring).

    Args:
        root: checkpoint root folder (created if missing).
        step: iteration number; an existing ``step_N`` is replaced.
        tensors: file stem -> named tensors, e.g. ``{"actor": model.state_dict()}``; each stem
            becomes ``<stem>.safetensors``.
        state: anything ``torch.save`` can write (optimizer state dicts, RNG states, data
            position, controller states).
        keep_last: keep this many complete checkpoints (the newest); 0 keeps all.
    Returns:
        The path of the complete checkpoint.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    if keep_last < 0:
        raise ValueError(f"keep_last={keep_last} must be >= 0")
    for stem in tensors:
        if not _NAME_RE.match(stem) or stem in (META, STATE):
            raise ValueError(f"tensor group name {stem!r} must be a plain file stem "
                             f"([A-Za-z0-9_.-])")
    os.makedirs(root, exist_ok=True)
    remove_partial(root)
    name = os.path.basename(step_dir(root, step))
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    files = {}
    for stem, named in tensors.items():
        path = os.path.join(tmp, f"{stem}.safetensors")
        save_file(_standalone(named), path)
        _fsync_file(path)
        files[os.path.basename(path)] = os.path.getsize(path)
    path = os.path.join(tmp, STATE)
    torch.save(state, path)
    _fsync_file(path)
    files[STATE] = os.path.getsize(path)
    meta_path = os.path.join(tmp, META)
    with open(meta_path, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "step": step, "files": files,
                   "tensor_groups": sorted(tensors)}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = step_dir(root, step)
    if os.path.exists(final):
        old = os.path.join(root, f".old-{name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    if keep_last:
        for old_step in complete_steps(root)[:-keep_last]:
            shutil.rmtree(step_dir(root, old_step), ignore_errors=True)
    return final


def is_complete(path: str) -> bool:
    """True if ``path`` has a readable ``meta.json`` whose files all exist with their sizes."""
    try:
        with open(os.path.join(path, META), encoding="utf-8") as f:
            meta = json.load(f)
        return all(os.path.getsize(os.path.join(path, n)) == size
                   for n, size in meta["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        if m and is_complete(os.path.join(root, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_complete(root: str) -> str | None:
    """Path of the newest complete checkpoint under ``root`` (None if there is none);
    temporary, replaced and incomplete folders are ignored.  What ``resume=auto`` loads."""
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def load_checkpoint(path: str) -> tuple[int, dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Read a complete checkpoint.

    Returns:
        ``(step, tensors, state)`` as given to :func:`save_checkpoint` (tensors on CPU).
    """
    if not is_complete(path):
        raise ValueError(f"checkpoint {path!r} is missing or incomplete (no valid {META})")
    with open(os.path.join(path, META), encoding="utf-8") as f:
        meta = json.load(f)
    tensors = {stem: load_file(os.path.join(path, f"{stem}.safetensors"))
               for stem in meta["tensor_groups"]}
    # our own file: it holds numpy RNG state and python objects, so not weights_only
    state = torch.load(os.path.join(path, STATE), map_location="cpu", weights_only=False)
    return int(meta["step"]), tensors, state


def resolve_resume(resume: str, root: str) -> str | None:
    """Checkpoint to resume from for ``checkpoint.resume``: ``auto`` -> latest complete (or
    None), ``never`` -> None, otherwise the given path (ValueError unless complete)."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_complete(root)
    if not is_complete(resume):
        raise ValueError(f"checkpoint.resume={resume!r} is not a complete checkpoint folder")
    return resume


# RNG state -----------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """RNG states of python ``random``, torch (CPU) and numpy (if installed)."""
    out = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        out["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return out


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
