"""Atomic, sharded checkpoints and ``resume=auto``.

One checkpoint is one folder under the checkpoint root::

    <root>/
      step_00000012/                  complete: renamed into place after everything was fsynced
        actor/                        one torch.distributed.checkpoint (DCP) folder per role
          __0_0.distcp __1_0.distcp   each rank's own blocks (weights, Adam moments), written by
          ...                         that rank, all ranks in parallel
          .metadata                   every global tensor: shape, dtype, its chunks and where
                                      each lies (file, byte offset, length)
        critic/ ...
        <stem>.safetensors            small named tensor dicts (:func:`save_checkpoint` only)
        state.pt                      the controller's state (step, prompt-stream position, KL
                                      controller, Lagrange multiplier, RNG) via torch.save
        meta.json                     written last: format, step, every file with its size
      .tmp-step_00000015-<pid>-<id>/  a save in progress (or killed): never read
      .old-step_00000012-<id>/        a replaced checkpoint on its way out: never read

Protocol: :func:`begin_checkpoint` makes the ``.tmp-`` folder and writes ``state.pt``; the
writers fill it, each fsyncing its own files; :func:`commit_checkpoint` fsyncs every folder,
writes and fsyncs ``meta.json``, renames the folder to ``step_N`` (atomic on POSIX) and fsyncs
the root.  A crash at any point leaves the previous complete checkpoints untouched and the new
one either complete or invisible: :func:`latest_complete` only considers ``step_N`` folders whose
``meta.json`` lists files that all exist with the recorded sizes.

Sharded tensors.  Every rank describes its piece of each global tensor as a :class:`Block`
(global shape, offsets, local tensor) and DCP does the rest: the default planners drop
duplicates (DP replicas, TP ranks of a replicated norm, the tied LM-head copy of the last
stage: same name and offsets), build the global metadata, and on load intersect the blocks a
rank needs with the saved chunks, so a rank reads only the saved chunks that overlap its own
blocks (DCP's resharding; any world size or layout).  Global tensors are named and shaped as
the HF checkpoint's (q/k/v and gate/up are separate tensors), where every rank's piece is one
box: a TP shard of a fused tensor is several row blocks of the fused global tensor, but exactly
one row block of each HF tensor (:mod:`engine.hf_shards`).

Why :class:`Block` and not DTensor or ShardedTensor (torch 2.13): DCP takes any object with
the ``_Checkpointable`` hooks (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``; DTensor implements them the same way).  DTensor would need a device
mesh per role built from our groups, and still could not state a fused shard or a tensor held
by one pipeline stage only; ShardedTensor is deprecated, its constructor runs a collective or
needs every rank's shard list, and it rejects replicas.  A Block is the three hooks on a plain
box; the planners below only teach DCP's default planners to look it up (its ``lookup`` only
knows tensors) and to fill a block whose local tensor is a strided view of a fused shard.

Asynchronous save: ``dcp.async_save`` runs the whole save, including its two collectives, in
a background thread.  Our roles' process groups carry training collectives at the same time,
and a gloo group needs one issue order on every rank, so that would need a second group per
role.  :class:`ShardedSave` runs DCP's own three save steps instead, only the middle one off
the caller's thread:

1. plan (caller, collective over the role's group, metadata only): local plans ->
   coordinator (dedup, global metadata) -> final plans; then copy the blocks this rank's plan
   writes into fresh CPU tensors (a replica's block is copied by the one rank that writes it);
2. write (background thread, no collective): ``FileSystemWriter.write_data`` writes and
   fsyncs this rank's file while training goes on;
3. finish (caller, a later call, collective): join, gather the write results, the coordinator
   writes ``.metadata`` (fsynced, renamed into place).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (ReadItem, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.utils import _DistWrapper

META = "meta.json"
STATE = "state.pt"
DCP_METADATA = ".metadata"
FORMAT = 2  # 1: full tensors as <role>.safetensors (before sharded checkpoints)
MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIM_STEP = "optim.step"
_STEP_RE = re.compile(r"step_(\d+)$")
_TMP_RE = re.compile(r"\.tmp-step_\d+-(\d+)-[0-9a-f]+$")
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+$")


def moment_key(moment: str, name: str) -> str:
    """Checkpoint name of Adam moment ``moment`` (exp_avg / exp_avg_sq) of tensor ``name``."""
    return f"optim.{moment}.{name}"


# The atomic folder --------------------------------------------------------------------------
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


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint being written: its writers fill ``tmp``; :func:`commit_checkpoint` ends it."""

    root: str
    step: int
    tmp: str
    """The ``.tmp-`` folder (every writer's files go under it)."""


def begin_checkpoint(root: str, step: int, state: dict[str, Any]) -> PendingCheckpoint:
    """Start checkpoint ``step``: a fresh ``.tmp-`` folder holding ``state.pt`` (fsynced).

    Args:
        root: checkpoint root folder (created if missing; stale partial saves are removed).
        step: iteration number; an existing ``step_N`` is replaced at commit.
        state: anything ``torch.save`` can write (controller state, RNG states, ...), captured
            now, not at commit.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    os.makedirs(root, exist_ok=True)
    remove_partial(root)
    name = os.path.basename(step_dir(root, step))
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    path = os.path.join(tmp, STATE)
    torch.save(state, path)
    _fsync_file(path)
    return PendingCheckpoint(root, step, tmp)


def commit_checkpoint(pending: PendingCheckpoint, keep_last: int = 0) -> str:
    """Make ``pending`` the complete ``step_N`` (see the module docstring).

    Every writer must have finished (its files fsynced).  Returns the checkpoint's path.

    Args:
        pending: from :func:`begin_checkpoint`.
        keep_last: keep this many complete checkpoints (the newest); 0 keeps all.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last={keep_last} must be >= 0")
    tmp, files, sharded = pending.tmp, {}, []
    for folder, dirs, names in os.walk(tmp):
        rel = os.path.relpath(folder, tmp)
        if DCP_METADATA in names and rel != ".":
            sharded.append(rel)
        for n in names:
            files[os.path.normpath(os.path.join(rel, n))] = os.path.getsize(
                os.path.join(folder, n))
        if folder != tmp:
            _fsync_dir(folder)
    groups = sorted(n.removesuffix(".safetensors") for n in files
                    if n.endswith(".safetensors") and os.sep not in n)
    with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "step": pending.step, "files": files,
                   "tensor_groups": groups, "sharded": sorted(sharded)}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    root, name = pending.root, os.path.basename(step_dir(pending.root, pending.step))
    final = step_dir(root, pending.step)
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
    """Write checkpoint ``step`` of small named tensor dicts from one process, atomically.

    (Role weights go through :class:`ShardedSave`, every rank writing its own blocks.)

    Args:
        root: checkpoint root folder (created if missing).
        step: iteration number; an existing ``step_N`` is replaced.
        tensors: file stem -> named tensors; each stem becomes ``<stem>.safetensors``.
        state: anything ``torch.save`` can write.
        keep_last: keep this many complete checkpoints (the newest); 0 keeps all.
    Returns:
        The path of the complete checkpoint.
    """
    for stem in tensors:
        if not _NAME_RE.match(stem) or stem in (META, STATE):
            raise ValueError(f"tensor group name {stem!r} must be a plain file stem "
                             f"([A-Za-z0-9_.-])")
    if keep_last < 0:
        raise ValueError(f"keep_last={keep_last} must be >= 0")
    pending = begin_checkpoint(root, step, state)
    for stem, named in tensors.items():
        path = os.path.join(pending.tmp, f"{stem}.safetensors")
        save_file(_standalone(named), path)
        _fsync_file(path)
    return commit_checkpoint(pending, keep_last)


def _read_meta(path: str) -> dict:
    with open(os.path.join(path, META), encoding="utf-8") as f:
        return json.load(f)


def is_complete(path: str) -> bool:
    """True if ``path`` has a readable ``meta.json`` whose files all exist with their sizes."""
    try:
        meta = _read_meta(path)
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


def read_state(path: str, sharded: bool = True) -> dict[str, Any]:
    """The ``state`` of a complete checkpoint (ValueError if incomplete, or if ``sharded`` and
    it predates sharded checkpoints)."""
    if not is_complete(path):
        raise ValueError(f"checkpoint {path!r} is missing or incomplete (no valid {META})")
    fmt = _read_meta(path).get("format")
    if sharded and fmt != FORMAT:
        raise ValueError(f"checkpoint {path!r} has format {fmt} (full tensors, written before "
                         f"sharded checkpoints); this version reads format {FORMAT}: resume "
                         f"with checkpoint.resume=never or from a newer checkpoint")
    # our own file: it holds numpy RNG state and python objects, so not weights_only
    return torch.load(os.path.join(path, STATE), map_location="cpu", weights_only=False)


def load_checkpoint(path: str) -> tuple[int, dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Read a complete checkpoint whole into this process (tests, tools, small models).

    Returns:
        ``(step, tensors, state)``: ``tensors`` has every ``<stem>.safetensors`` group and,
        for each sharded role folder, ``role`` (global weights by name), ``role.exp_avg`` and
        ``role.exp_avg_sq`` (Adam moments of a trained role); ``state["optim"][role]`` is the
        role's optimizer step count.
    """
    state = read_state(path, sharded=False)
    meta = _read_meta(path)
    tensors = {stem: load_file(os.path.join(path, f"{stem}.safetensors"))
               for stem in meta["tensor_groups"]}
    optim = {}
    for role in meta.get("sharded", []):
        full = read_sharded(os.path.join(path, role))
        if OPTIM_STEP in full:
            optim[role] = int(full.pop(OPTIM_STEP))
        for k, v in full.items():
            group, name = role, k
            for m in MOMENTS:
                if k.startswith(moment_key(m, "")):
                    group, name = f"{role}.{m}", k.removeprefix(moment_key(m, ""))
            tensors.setdefault(group, {})[name] = v
    if meta.get("sharded"):
        state = state | {"optim": optim}
    return int(meta["step"]), tensors, state


# Blocks: one rank's box of a global tensor, as DCP sees it ---------------------------------
@dataclass(frozen=True, eq=False)
class Block:
    """This rank's box ``[offsets, offsets + sizes)`` of a global tensor of ``shape``.

    ``local`` holds the box's elements in row-major order: shaped ``sizes`` (a view of the
    model's memory, or a snapshot), or, for a part of a fused TP shard whose rows are not one
    stride apart, grouped ``[sizes[0] // r, r, *sizes[1:]]``::

        fused qkv shard of rank t     q_proj (global, HF)        this rank's box: rows
        | q | k | v |  group g        rows [0, G*r),             [t*G*r/tp, (t+1)*G*r/tp)
        | q | k | v |  group g+1  ->  r = q rows per group  ==   local = the shard viewed
          \\ q rows: local[:, :r]                                 [G/tp, rows/group, H][:, :r]

    Loads into a grouped block are staged through one saved chunk's worth of rows
    (:class:`BlockLoadPlanner`); saves always go through :meth:`snapshot`.
    """

    local: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.shape) == len(self.offsets) == len(self.sizes):
            raise ValueError(f"block of shape {self.shape}: offsets {self.offsets} and sizes "
                             f"{self.sizes} need one entry per dim")
        if any(o < 0 or o + s > n for o, s, n in zip(self.offsets, self.sizes, self.shape)):
            raise ValueError(f"block offsets {self.offsets} + sizes {self.sizes} outside the "
                             f"global shape {self.shape}")
        if self.local.numel() != torch.Size(self.sizes).numel():
            raise ValueError(f"local tensor {tuple(self.local.shape)} does not hold a "
                             f"{self.sizes} box")

    @property
    def grouped(self) -> bool:
        return tuple(self.local.shape) != self.sizes

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))

    def size(self) -> torch.Size:
        """The global shape (what DCP's load planner compares with the saved one)."""
        return torch.Size(self.shape)

    def snapshot(self) -> Block:
        """A copy in fresh host memory, shaped like the box (what the writer thread writes)."""
        copy = torch.empty(self.local.shape, dtype=self.local.dtype, device="cpu")
        copy.copy_(self.local)
        return Block(copy.view(self.sizes), self.shape, self.offsets, self.sizes)

    def rows_(self, start: int, rows: torch.Tensor) -> None:
        """Copy ``rows`` (a box of whole trailing dims) into box rows ``start:`` of a grouped
        block."""
        r = self.local.shape[1]
        assert start % r == 0 and rows.shape[0] % r == 0, (start, rows.shape, r)
        assert tuple(rows.shape[1:]) == self.sizes[1:], (rows.shape, self.sizes)
        dst = self.local[start // r:(start + rows.shape[0]) // r]  # [n / r, r, *rest]
        dst.copy_(rows.view(dst.shape))

    # DCP's _Checkpointable hooks
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(self.offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=self.chunk,
                              properties=TensorProperties.create_from_tensor(self.local),
                              size=torch.Size(self.shape)))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self.chunk]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        assert tuple(index.offset) == self.offsets and not self.grouped, (index, self.offsets)
        return self.local


@dataclass(frozen=True, eq=False)
class Blocks:
    """Several boxes of one global tensor on this rank, each a :class:`Block` (e.g. a whole
    expert stored as its generation pieces, :func:`hybridflow_comm.expert_reshard.
    stacked_pieces`: one contiguous box per piece); DCP's hooks over every part."""

    parts: tuple[Block, ...]

    def size(self) -> torch.Size:
        return self.parts[0].size()

    def part(self, offsets) -> Block:
        """The part whose box starts at ``offsets``."""
        return next(p for p in self.parts if p.offsets == tuple(offsets))

    def snapshot(self) -> Blocks:
        return Blocks(tuple(p.snapshot() for p in self.parts))

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [item for p in self.parts for item in p.__create_write_items__(fqn, p)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [p.chunk for p in self.parts]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.part(index.offset).__get_tensor_shard__(index)


def _snapshot(fqn: str, value, mine: set) -> Block | Blocks | torch.Tensor:
    """What the writer thread writes of ``value``: a snapshot of a block, of the parts of
    ``Blocks`` this rank writes (by ``(fqn, offsets)`` in ``mine``), or a tensor's clone."""
    if isinstance(value, Blocks):
        return Blocks(tuple(p.snapshot() for p in value.parts if (fqn, p.offsets) in mine))
    return value.snapshot() if isinstance(value, Block) else value.clone()


class BlockSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (dedup, global metadata) for a flat dict of :class:`Block`
    snapshots and plain tensors (replicated values, deduplicated by name)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, (Block, Blocks)):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class BlockLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (a rank reads the saved chunks that overlap its blocks)
    for a flat dict of :class:`Block` and plain tensors, filled in place.

    Attributes:
        read_bytes: bytes of the saved chunks this rank reads (after :meth:`finish_plan`).
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.read_bytes = 0

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default set-up maps every value through a tensor-only visitor, which would
        # replace a Block by None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def finish_plan(self, new_plan):
        md = self.metadata.state_dict_metadata
        chunks = {(r.storage_index.fqn, r.storage_index.index) for r in new_plan.items}
        self.read_bytes = sum(md[f].chunks[i].sizes.numel() * md[f].properties.dtype.itemsize
                              for f, i in chunks)
        return new_plan

    def _block(self, read_item: ReadItem):
        obj = self.state_dict[read_item.dest_index.fqn]
        return obj.part(read_item.dest_index.offset) if isinstance(obj, Blocks) else obj

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        obj = self._block(read_item)
        if not isinstance(obj, Block):
            return super().resolve_tensor(read_item)
        if obj.grouped:  # staged, then copied by commit_tensor
            return torch.empty(tuple(read_item.lengths), dtype=obj.local.dtype, device="cpu")
        view = obj.local
        for dim, (start, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, n)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        obj = self._block(read_item)
        if isinstance(obj, Block) and obj.grouped:
            assert not any(read_item.dest_offsets[1:]), read_item
            obj.rows_(read_item.dest_offsets[0], tensor)


# Saving and loading the blocks of a role ----------------------------------------------------
def _dist(pg: dist.ProcessGroup | None) -> _DistWrapper:
    """DCP's exception-safe object collectives on the role's group (none for one rank)."""
    return _DistWrapper(pg, pg is not None, 0)


class ShardedSave:
    """One rank's part of an asynchronous DCP save of a role (module docstring, steps 1-3).

    Construction is step 1 (collective over ``pg``; returns once the rank's blocks are copied);
    the rank's file is then written by a background thread; :meth:`finish` is step 3 (collective;
    the coordinator writes ``.metadata``).  Every rank of the group calls both, in order.

    Args:
        folder: the role's DCP folder (created).
        state: name -> :class:`Block` or tensor (a replicated value, e.g. the optimizer step).
        pg: the role's process group (every rank of the role), None for a one-rank role.
    """

    def __init__(self, folder: str, state: dict[str, Block | torch.Tensor],
                 pg: dist.ProcessGroup | None) -> None:
        self._dist = _dist(pg)
        self._writer = FileSystemWriter(folder, sync_files=True, thread_count=1)
        self._planner = BlockSavePlanner()
        self._metadata = None
        self._results: list | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

        def local_plan():  # shapes and offsets only: the live blocks will do
            self._planner.set_up_planner(state, self._writer.storage_meta(),
                                         self._dist.is_coordinator)
            self._writer.set_up_storage_writer(self._dist.is_coordinator, rank=self._dist.rank,
                                               use_collectives=True)
            return self._writer.prepare_local_plan(self._planner.create_local_plan())

        def global_plan(plans):
            plans, self._metadata = self._planner.create_global_plan(plans)
            return self._writer.prepare_global_plan(plans)

        plan = self._planner.finish_plan(self._dist.reduce_scatter("plan", local_plan,
                                                                   global_plan))
        # copy only what this rank writes (a replicated block is written by one rank, and the
        # boxes of Blocks may go to different replicas)
        mine = {(item.index.fqn, tuple(item.index.offset or ())) for item in plan.items}
        fqns = {fqn for fqn, _ in mine}
        self._planner.state_dict = {k: _snapshot(k, v, mine) for k, v in state.items()
                                    if k in fqns}
        self._thread = threading.Thread(target=self._write, args=(plan,), daemon=True,
                                        name=f"dcp-save:{folder}")
        self._thread.start()

    def _write(self, plan) -> None:
        try:
            self._results = self._writer.write_data(plan, self._planner).value()
        except BaseException as e:  # noqa: BLE001 - re-raised on every rank by finish()
            self._error = e
        finally:
            self._planner.state_dict = None  # the snapshot is on disk: free it now

    def finish(self) -> None:
        """Wait for this rank's file, then the coordinator writes ``.metadata`` (collective;
        raises on every rank if any rank's write failed)."""

        def local_results():
            self._thread.join()
            if self._error is not None:
                raise self._error
            return self._results

        def write_metadata(all_results):
            self._writer.finish(self._metadata, all_results)

        self._dist.all_reduce("write", local_results, write_metadata)


def load_blocks(folder: str, state: dict[str, Block | torch.Tensor],
                pg: dist.ProcessGroup | None) -> int:
    """Fill ``state`` in place from the DCP folder of a role (collective over ``pg``).

    Each rank reads only the saved chunks that overlap its blocks.  Returns the bytes of the
    saved chunks this rank read.
    """
    if not os.path.isfile(os.path.join(folder, DCP_METADATA)):
        raise ValueError(f"{folder!r} holds no sharded checkpoint (no {DCP_METADATA})")
    planner = BlockLoadPlanner()
    with warnings.catch_warnings():  # a one-rank role in a multi-rank job loads without dist
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(folder), planner=planner,
                 process_group=pg, no_dist=pg is None)
    return planner.read_bytes


def read_sharded(folder: str) -> dict[str, torch.Tensor]:
    """Every global tensor of a role's DCP folder, whole, in this process (no collective)."""
    md = FileSystemReader(folder).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype, device="cpu")
             for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    planner = BlockLoadPlanner()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(folder), planner=planner, no_dist=True)
    return state


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
