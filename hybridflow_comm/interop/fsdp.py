"""Interop from FSDP2 / ZeRO-3: DTensors sharded ``Shard(0)`` over a data-parallel mesh axis
(optionally x a TP axis, as torchtitan builds) -> any generation layout ``(p_g, t_g)`` on the
same ranks.

    tr = from_fsdp(dict(model.named_parameters()), (1, 2), dp_axis="dp", tp_dims=dims)
    tr.to_generation()                    # generation shards in a separate flat buffer
    engine.load_weights(tr.named_generation_weights())
    tr.to_training()                      # releases the generation buffer's pages

Frameworks hand weights to generation today by gathering the full model on every rank
(``get_model_state_dict(..., full_state_dict=True)``: ``(W - 1)/W M`` received per rank).  Here
each rank receives only the blocks of its generation shard that it does not hold, from the ranks
that hold them (one batch of point-to-point messages per bucket, contiguous blocks straight
from the shard into the buffer); the minimum, written and derived in :mod:`.fsdp_plan`::

    recv(r) = sum_X e_X (|G_r(X)| - |G_r(X) n B_r(X)|)
            = (W - t_g)/(t_g W) M_col + (W - 1)/(t_g W) M_row + (W - 1)/W M_rep   (1-D, p_g = 1)

Memory: the FSDP shards are never written (the optimizer's view never changes); the generation
shards live in their own :class:`FlatParamBuffer` (one page-aligned storage per dtype, one
region per tensor in its logical generation shape), filled by one local copy of the held part
plus the received blocks, and released by ``to_training()``::

    FSDP shard (DTensor local, untouched)      generation buffer (this rank, one per dtype)
    | rows [r R/W, (r+1) R/W) of every X |  -> | X0 [R/t_g, C] | X1 [R, C/t_g] | norm [C] | ...
                                   local copy ^   ^ received blocks (in place; strided ones
                                                    through a staging buffer)

The generation placement is explicit: ``gen=(p_g, t_g)`` picks the local-first one (the ranks
holding dim-0 chunk ``k`` of ``W`` get the generation TP rank ``k // (W / t_g)``, so column-
parallel shards are mostly local); a ParallelLayout ``(p_g, t_g, d_g)`` (tp fastest) or a
HybridLayout picks theirs.  ``tr.placement.tp_groups()`` lists the generation TP groups for the
engine.  ``p_g > 1`` needs ``gen_stages`` (tensor -> generation stage).

Every check reads metadata only and is the same on every rank, so a bad input (uneven FSDP
shards, ``Partial``, a mesh that does not cover the group, a ``t_g`` that does not divide the
heads) raises ValueError naming the tensor and the fix on every rank before any collective.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hybridflow_comm import comm
from hybridflow_comm.comm import CommLedger
from hybridflow_comm.flat_buffer import FlatParamBuffer, SlotSpec
from hybridflow_comm.groups import Group
from hybridflow_comm.interop.fsdp_plan import (Block, Box, ConcatFusion, GenPlacement, GenTensor,
                                               MeshSpec, SourcePlacement, box_is_contiguous,
                                               min_received_bytes, plan_blocks, plan_rounds)
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import Fusion, QKVFusion, hf_named
from hybridflow_comm.transition import BUCKET_BYTES, LABEL, TransitionStats, check_bucket_bytes

__all__ = ["ConcatFusion", "FSDPTransition", "GenerationWeights", "describe_fsdp", "from_fsdp"]

PerName = Mapping[str, Any] | Callable[[str], Any]
Tensors = list[tuple[GenTensor, SourcePlacement]]


def _lookup(table: PerName | None, name: str, default: Any = KeyError) -> Any:
    if table is None:
        return default
    if callable(table):
        return table(name)
    return table.get(name, default)


# Validation (metadata only, identical on every rank) ----------------------------------------
def _axis(mesh, axis: int | str | None, what: str, name: str) -> int | None:
    if axis is None:
        return None
    names = mesh.mesh_dim_names or ()
    if isinstance(axis, str):
        if axis not in names:
            raise ValueError(f"{name}: mesh axes {names} have no {what} axis named {axis!r}; "
                             f"pass {what}_axis= one of {names}")
        return names.index(axis)
    if not 0 <= axis < mesh.ndim:
        raise ValueError(f"{name}: {what}_axis={axis} is not an axis of a {mesh.ndim}-D mesh")
    return axis


def _on_root(name: str, v: DTensor) -> tuple[Any, tuple]:
    """``(root mesh, placements on it)``: a DTensor on a sub-mesh (``mesh["dp"]`` of a
    ``(dp, tp)`` mesh, as fully_shard leaves tensors that TP did not touch) is replicated over
    the root's other axes."""
    mesh = v.device_mesh
    root = mesh._get_root_mesh()  # torch's sub-mesh bookkeeping (no public accessor)
    if root is mesh or root.mesh_dim_names == mesh.mesh_dim_names:
        return mesh, tuple(v.placements)
    names = root.mesh_dim_names or ()
    if not mesh.mesh_dim_names or any(n not in names for n in mesh.mesh_dim_names):
        raise ValueError(f"{name}: its mesh axes {mesh.mesh_dim_names} are not axes of the root "
                         f"mesh {names} (a flattened mesh?); shard it on the root mesh's axes")
    placements = [Replicate()] * root.ndim
    for axis, pl in zip(mesh.mesh_dim_names, v.placements):
        placements[names.index(axis)] = pl
    return root, tuple(placements)


def _mesh_spec(roots: dict[str, tuple[Any, tuple]], ranks: list[int], dp_axis, tp_axis
               ) -> MeshSpec:
    """The one (root) mesh of every DTensor; it must cover exactly the group's ranks."""
    if not roots:  # plain tensors only: replicated everywhere
        return MeshSpec((len(ranks),), tuple(ranks), 0)
    name0, (mesh, _) = next(iter(roots.items()))
    layout = (mesh.mesh.tolist(), mesh.mesh_dim_names)
    for name, (m, _) in roots.items():
        if (m.mesh.tolist(), m.mesh_dim_names) != layout:
            raise ValueError(f"{name}: its device mesh {m} differs from {name0}'s {mesh}; put "
                             f"every tensor on one (dp[, tp]) mesh or its sub-meshes")
    flat = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    if sorted(flat) != sorted(ranks):
        raise ValueError(f"{name0}: the device mesh covers ranks {sorted(flat)} but the "
                         f"transition's group has ranks {sorted(ranks)}; build the mesh over "
                         f"every rank (init_device_mesh(device, (dp,) or (dp, tp))) or pass "
                         f"group= the mesh's process group")
    dp = _axis(mesh, dp_axis, "dp", name0)
    tp = _axis(mesh, tp_axis, "tp", name0)
    if dp == tp:
        raise ValueError(f"{name0}: dp_axis and tp_axis are both mesh axis {dp}")
    return MeshSpec(tuple(mesh.shape), flat, dp, tp)


def _placement(name: str, v: torch.Tensor, placements: tuple | None, mesh: MeshSpec
               ) -> SourcePlacement:
    """The tensor's SourcePlacement; ValueError for anything that is not FSDP (x TP)."""
    if v.ndim == 0:
        raise ValueError(f"{name}: a 0-d tensor cannot be sharded; store it with shape (1,)")
    if placements is None:
        return SourcePlacement(dp_sharded=False)
    dp_sharded, tp_dim, strided = False, None, False
    for a, pl in enumerate(placements):
        if pl.is_partial():
            raise ValueError(f"{name}: placement {pl} on mesh axis {a} is a pending reduction "
                             f"(Partial), not a shard; reduce it first: dt.redistribute("
                             f"dt.device_mesh, [Shard(0) or Replicate() per axis])")
        role = "dp" if a == mesh.dp_axis else "tp" if a == mesh.tp_axis else None
        if isinstance(pl, Replicate):
            continue
        if role == "dp" and isinstance(pl, _StridedShard) and pl.dim == 0 \
                and pl.split_factor == mesh.tp:
            dp_sharded, strided = True, True
        elif role == "dp" and isinstance(pl, Shard) and pl.dim == 0:
            dp_sharded = True
        elif role == "tp" and isinstance(pl, Shard) and not isinstance(pl, _StridedShard):
            tp_dim = pl.dim % v.ndim
        elif role == "dp":
            raise ValueError(f"{name}: placement {pl} on the dp (FSDP) mesh axis {a}; FSDP "
                             f"shards dim 0: use Shard(0) (fully_shard's default)")
        else:
            raise ValueError(f"{name}: placement {pl} on mesh axis {a}, which is neither "
                             f"dp_axis={mesh.dp_axis} nor tp_axis={mesh.tp_axis}; name the TP "
                             f"axis with tp_axis= or make it Replicate()")
    if strided and tp_dim != 0:
        raise ValueError(f"{name}: _StridedShard on the dp axis needs Shard(0) on the tp axis, "
                         f"got placements {placements}")
    return SourcePlacement(dp_sharded, tp_dim, strided)


def _check_even(name: str, v: torch.Tensor, src: SourcePlacement, mesh: MeshSpec, rank: int
                ) -> None:
    for dim in {0, src.tp_dim} - {None}:
        parts = src.parts(mesh, dim)
        if v.shape[dim] % parts:
            raise ValueError(f"{name}: dim {dim} of global shape {tuple(v.shape)} is not "
                             f"divisible by the {parts} shards over the mesh (uneven FSDP "
                             f"shards); pad dim {dim} to a multiple of {parts}, pick a dp that "
                             f"divides {v.shape[dim]}, or keep the tensor replicated")
    local = v.to_local() if isinstance(v, DTensor) else v
    if local.numel() and local.stride(-1) != 1:
        raise ValueError(f"{name}: the local shard's last dim is strided ({local.stride()}); "
                         f"pass a contiguous tensor")
    if isinstance(v, DTensor):
        want = tuple(hi - lo for lo, hi in src.box(tuple(v.shape), mesh, rank))
        if tuple(local.shape) != want:
            raise ValueError(f"{name}: local shard shape {tuple(local.shape)} != "
                             f"{want} expected from its placements (padded shard?)")


def _gen_tensor(name: str, v: torch.Tensor, src: SourcePlacement, has_tp: bool,
                tp_dims: PerName | None, fusions: Mapping[str, Any], gen_stages: PerName | None,
                pp_g: int) -> GenTensor:
    """The generation side: partition dim from ``tp_dims``, else the TP shard dim (None when
    replicated over TP), else an error."""
    dim = _lookup(tp_dims, name, src.tp_dim if has_tp else KeyError)
    if dim is KeyError:
        raise ValueError(f"{name}: no generation partition dim (the mesh has no TP axis to take "
                         f"it from); pass tp_dims={{{name!r}: 0 "
                         f"(column-parallel) | 1 (row-parallel) | None (replicated)}} or a "
                         f"callable name -> dim")
    if dim is not None and not 0 <= dim < v.ndim:
        raise ValueError(f"{name}: tp_dims gives dim {dim} for shape {tuple(v.shape)}")
    stage = _lookup(gen_stages, name, 0 if pp_g == 1 else KeyError)
    if stage is KeyError or not (isinstance(stage, int) and 0 <= stage < pp_g):
        raise ValueError(f"{name}: generation stage {stage if stage is not KeyError else None} "
                         f"is not in [0, pp_g={pp_g}); pass gen_stages= name -> stage")
    return GenTensor(name, tuple(v.shape), v.dtype.itemsize, dim, stage, fusions.get(name))


def _placement_of(gen: Any, mesh: MeshSpec, ranks: list[int]) -> GenPlacement:
    if isinstance(gen, GenPlacement):
        if gen.ranks != tuple(sorted(ranks)):
            raise ValueError(f"generation placement ranks {gen.ranks} != the mesh's {ranks}")
        return gen
    if isinstance(gen, (ParallelLayout, HybridLayout)):
        return GenPlacement.from_layout(gen, ranks)
    if isinstance(gen, tuple) and len(gen) == 2 and all(isinstance(x, int) for x in gen):
        return GenPlacement.in_order(mesh.locality_order(), gen[0], gen[1])
    raise TypeError(f"gen must be (p_g, t_g), a ParallelLayout, a HybridLayout or a "
                    f"GenPlacement, got {gen!r}")


def describe_fsdp(state_dict: Mapping[str, torch.Tensor], gen: Any, ranks: list[int], rank: int,
                  *, dp_axis: int | str = "dp", tp_axis: int | str | None = None,
                  tp_dims: PerName | None = None, fusions: Mapping[str, Fusion | ConcatFusion]
                  | None = None, gen_stages: PerName | None = None
                  ) -> tuple[MeshSpec, GenPlacement, Tensors]:
    """Validate a sharded state dict (metadata only, no collective) and describe it.

    Returns:
        ``(mesh, placement, tensors)``: the mesh, the generation placement and, per tensor in
        state-dict order, its generation side and source placement.
    """
    fusions = dict(fusions or {})
    unknown = sorted(set(fusions) - set(state_dict))
    if unknown:
        raise ValueError(f"fusions given for tensors not in the state dict: {unknown}")
    for name, v in state_dict.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name}: expected a DTensor or torch.Tensor, got {type(v).__name__}")
    devices = {n: (v.to_local() if isinstance(v, DTensor) else v).device.type
               for n, v in state_dict.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors live on several devices {devices}; move them to one")
    roots = {n: _on_root(n, v) for n, v in state_dict.items() if isinstance(v, DTensor)}
    mesh = _mesh_spec(roots, ranks, dp_axis, tp_axis)
    place = _placement_of(gen, mesh, ranks)
    tensors = []
    for name, v in state_dict.items():
        src = _placement(name, v, roots[name][1] if name in roots else None, mesh)
        _check_even(name, v, src, mesh, rank)
        g = _gen_tensor(name, v, src, mesh.tp_axis is not None, tp_dims, fusions, gen_stages,
                        place.pp_g)
        g.check(place.tp_g)
        tensors.append((g, src))
    return mesh, place, tensors


def _group(group: dist.ProcessGroup | None) -> Group:
    if not (dist.is_available() and dist.is_initialized()):
        return Group((0,), 0, None)
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not in the transition's group {list(ranks)}")
    return Group(ranks, ranks.index(me), (group or dist.group.WORLD) if len(ranks) > 1 else None)


def from_fsdp(state_dict: Mapping[str, torch.Tensor], gen: Any, *, dp_axis: int | str = "dp",
              tp_axis: int | str | None = None, tp_dims: PerName | None = None,
              fusions: Mapping[str, Fusion | ConcatFusion] | None = None,
              hf_names: PerName | None = None, gen_stages: PerName | None = None,
              group: dist.ProcessGroup | None = None, bucket_bytes: int = BUCKET_BYTES,
              ledger: CommLedger | None = None) -> FSDPTransition:
    """A transition from an FSDP(-x-TP) sharded state dict to a generation layout.

    Args:
        state_dict: name -> DTensor (``Shard(0)`` / ``_StridedShard(0)`` / ``Replicate`` on the
            dp axis, ``Shard(d)`` / ``Replicate`` on the tp axis, ``Replicate`` elsewhere) or
            plain tensor (replicated).  Pass the parameters themselves (``named_parameters``):
            their local shards are read at every ``to_generation()``.
        gen: ``(p_g, t_g)`` (local-first placement), a ParallelLayout ``(p_g, t_g, d_g)``, a
            HybridLayout, or a :class:`GenPlacement`.
        dp_axis / tp_axis: mesh axis names or indices of FSDP and TP (tp_axis None: no TP).
        tp_dims: name -> generation partition dim (None: replicated); defaults to the TP shard
            dim; required for every tensor of a mesh without a TP axis.
        fusions: fused layouts by name (QKVFusion / GateUpFusion / ConcatFusion).
        hf_names: Hugging Face names by name; one per fused part.
        gen_stages: name -> generation stage (needed when ``p_g > 1``).
        group: the process group of the mesh's ranks (default: the world).
        bucket_bytes: bytes per round: each pair moves at most ``bucket_bytes / (W - 1)``
            (this bounds the staging buffer of strided blocks).
        ledger: where bytes are recorded.

    Returns:
        An :class:`FSDPTransition`; construction exchanges one digest over ``group``.
    """
    check_bucket_bytes(bucket_bytes)
    g = _group(group)
    mesh, place, tensors = describe_fsdp(
        state_dict, gen, list(g.ranks), g.ranks[g.rank], dp_axis=dp_axis, tp_axis=tp_axis,
        tp_dims=tp_dims, fusions=fusions, gen_stages=gen_stages)
    names = {}
    for gt, _ in tensors:
        hf = tuple(_lookup(hf_names, gt.name, ()) or ())
        parts = _num_parts(gt.fusion)
        if hf and len(hf) != parts:
            raise ValueError(f"{gt.name}: {len(hf)} hf_names {hf} for {parts} fused part(s)")
        names[gt.name] = hf
    return FSDPTransition(dict(state_dict), tensors, mesh, place, g, hf_names=names,
                          bucket_bytes=bucket_bytes, ledger=ledger)


def _num_parts(fusion: Fusion | ConcatFusion | None) -> int:
    if fusion is None:
        return 1
    if isinstance(fusion, ConcatFusion):
        return len(fusion.part_rows)
    return 3 if isinstance(fusion, QKVFusion) else 2


# The generation side ---------------------------------------------------------------------------
class GenerationWeights:
    """This rank's generation shards in their own flat buffer, with version and mode.

    Args:
        tensors: the generation tensors of this rank's generation stage.
        dtypes: their element types, by name.
        tp_g: generation TP size.
        hf_names: Hugging Face names by tensor name (empty: keep the name).
        ledger: where the transition records bytes.
        device: where the buffer lives (the FSDP shards' device).
    """

    def __init__(self, tensors: list[GenTensor], dtypes: dict[str, torch.dtype], tp_g: int,
                 hf_names: dict[str, tuple[str, ...]], ledger: CommLedger,
                 device: torch.device = torch.device("cpu")) -> None:
        self.tensors = {g.name: g for g in tensors}
        # own_slot=None: no slot is a training shard, so to_training() releases every page.
        self.buffer = FlatParamBuffer([SlotSpec(g.name, dtypes[g.name], g.shard_shape(tp_g), 1,
                                                None) for g in tensors], device=device)
        self.hf_names = hf_names
        self.ledger = ledger
        self.version = 0
        self.mode = "training"

    def view(self, name: str) -> torch.Tensor:
        """The generation tensor ``name`` (a view of the buffer, logical shape)."""
        return self.buffer.slot_view(name, 0)

    def generation_params(self) -> dict[str, torch.Tensor]:
        return {name: self.view(name) for name in self.tensors}

    def named_generation_weights(self, hf_names: bool = True
                                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every generation shard (views); fused tensors split into their
        parts under ``hf_names`` (what inference engines' ``load_weights`` take)."""
        if self.mode != "generation":
            raise RuntimeError("named_generation_weights() needs generation mode")
        for name, g in self.tensors.items():
            hf = self.hf_names.get(name, ()) if hf_names else ()
            yield from hf_named(name, self.view(name), hf, g.fusion)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` (last dim contiguous) as uint8, last dim in bytes."""
    return t.view(torch.uint8)


@dataclass(frozen=True)
class _Message:
    """One block on the wire, seen from this rank.

    Attributes:
        block: the block.
        peer: group rank of the other side.
        staged: byte offset in the staging buffer, or None when the block's view is contiguous
            and goes straight from the FSDP shard / into the generation buffer.
    """

    block: Block
    peer: int
    staged: int | None


@dataclass(frozen=True)
class _Round:
    """This rank's messages of one round (in the order both sides post them)."""

    sends: list[_Message]
    recvs: list[_Message]
    staging_bytes: int


class FSDPTransition:
    """FSDP(-x-TP) shards -> generation shards (``method = "fsdp"``), minimum bytes.

    Implements :class:`~hybridflow_comm.transition.Transition` with :class:`GenerationWeights`
    as its ``weights``.  Built by :func:`from_fsdp`; the plan (blocks, rounds, which blocks go
    through the staging buffer) is made once here and replayed by every :meth:`to_generation`.

    Each round is one batch of point-to-point messages, one per block.  A block that is a
    contiguous run of its FSDP shard (a column-parallel row range) is sent from the shard
    itself, one that is a contiguous run of the generation tensor (every block of a 1-D mesh)
    is received straight into the generation buffer; only strided ones (a row-parallel block
    ``rows x cols/t_g`` of a shard, or a destination under 2-D TP) pass through a staging
    buffer of at most the round's bytes.
    """

    method = "fsdp"

    def __init__(self, sources: dict[str, torch.Tensor], tensors: Tensors, mesh: MeshSpec,
                 placement: GenPlacement, group: Group, *, hf_names: dict[str, tuple[str, ...]],
                 bucket_bytes: int = BUCKET_BYTES, ledger: CommLedger | None = None) -> None:
        self.mesh, self.placement, self.group = mesh, placement, group
        self.tensors = tensors
        self.rank = group.ranks[group.rank]
        self._sources = [sources[g.name] for g, _ in tensors]
        ledger = ledger if ledger is not None else CommLedger()
        self._exchange_digest(ledger)
        stage = placement.coord(self.rank)[0]
        mine = [g for g, _ in tensors if g.stage == stage]
        self.device = self._local_shard(0).device if tensors else torch.device("cpu")
        self.weights = GenerationWeights(mine, {g.name: sources[g.name].dtype for g in mine},
                                         placement.tp_g, hf_names, ledger, self.device)
        blocks = plan_blocks(tensors, mesh, placement)
        pair = max(1, bucket_bytes // max(1, group.size - 1))
        self._local = [b for b in blocks if b.src == b.dst == self.rank]
        self._rounds = [self._round(r) for r in plan_rounds(blocks, pair)]
        self._last: TransitionStats | None = None

    def _exchange_digest(self, ledger: CommLedger) -> None:
        """Every rank must have described the same tensors, mesh and placement."""
        desc = repr((self.mesh, self.placement, self.tensors)).encode()
        mine = torch.tensor([int.from_bytes(hashlib.sha256(desc).digest()[:8], "little",
                                            signed=True)])
        every = comm.all_gather_tensor(mine, self.group, ledger, "meta")
        if not bool((every == mine).all()):
            digests = every.view(-1).tolist()
            bad = [r for r, d in zip(self.group.ranks, digests) if d != digests[0]]
            raise ValueError(f"ranks {bad} describe the state dict differently from rank "
                             f"{self.group.ranks[0]} (names, shapes, placements or options)")

    def _round(self, blocks: list[Block]) -> _Round:
        """This rank's messages of one round; strided ones get staging offsets."""
        index = {r: k for k, r in enumerate(self.group.ranks)}
        contiguous_src = [self._local_shard(i).is_contiguous() for i in range(len(self.tensors))]
        off = 0
        sends, recvs = [], []
        for b in sorted((b for b in blocks if b.src == self.rank), key=lambda b: index[b.dst]):
            direct = contiguous_src[b.tensor] and box_is_contiguous(
                b.src_box, self._local_shard(b.tensor).shape)
            sends.append(_Message(b, index[b.dst], None if direct else off))
            off += 0 if direct else b.nbytes
        for b in sorted((b for b in blocks if b.dst == self.rank), key=lambda b: index[b.src]):
            gen = self.tensors[b.tensor][0]
            direct = box_is_contiguous(b.dst_box, gen.shard_shape(self.placement.tp_g))
            recvs.append(_Message(b, index[b.src], None if direct else off))
            off += 0 if direct else b.nbytes
        return _Round(sends, recvs, off)

    # Transition ---------------------------------------------------------------------------
    def to_generation(self) -> TransitionStats:
        """Fill every generation tensor; returns this rank's stats (``peak_weight_bytes``:
        FSDP shard + generation buffer + staging; ``redundant_bytes``: that minus the
        generation shard)."""
        w = self.weights
        if w.mode != "training":
            raise RuntimeError(f"to_generation() called in {w.mode} mode")
        sent0, recv0, calls0 = w.ledger.snapshot(LABEL)
        t0 = time.perf_counter()
        scratch = self._fill()
        elapsed = time.perf_counter() - t0
        w.version += 1
        w.mode = "generation"
        sent1, recv1, calls1 = w.ledger.snapshot(LABEL)
        shard = sum(self._local_shard(i).nbytes for i in range(len(self.tensors)))
        peak = shard + w.buffer.gen_nbytes + scratch
        self._last = TransitionStats(self.method, w.version, sent1 - sent0, recv1 - recv0,
                                     calls1 - calls0, peak, peak - w.buffer.gen_nbytes, elapsed)
        return self._last

    def to_training(self, release: bool = True) -> int:
        """Back to training (the FSDP shards never changed); returns the bytes released."""
        w = self.weights
        if w.mode != "generation":
            raise RuntimeError(f"to_training() called in {w.mode} mode")
        w.mode = "training"
        return w.buffer.release_generation_slots() if release else 0

    def accounting(self) -> TransitionStats | None:
        """Stats of the last :meth:`to_generation` (None before the first)."""
        return self._last

    def minimum_received_bytes(self) -> int:
        """This rank's minimum received bytes (:func:`.fsdp_plan.min_received_bytes`)."""
        return min_received_bytes(self.tensors, self.mesh, self.placement, self.rank)

    def exchange_bytes(self) -> tuple[list[int], list[int]]:
        """``(sent, received)`` bytes per group member over all rounds of one transition (the
        traffic matrix row and column of this rank; a raw all-to-all of it is the limit)."""
        sent, received = [0] * self.group.size, [0] * self.group.size
        for r in self._rounds:
            for m in r.sends:
                sent[m.peer] += m.block.nbytes
            for m in r.recvs:
                received[m.peer] += m.block.nbytes
        return sent, received

    def named_generation_weights(self, hf_names: bool = True
                                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`GenerationWeights.named_generation_weights`."""
        return self.weights.named_generation_weights(hf_names)

    def generation_params(self) -> dict[str, torch.Tensor]:
        return self.weights.generation_params()

    @property
    def version(self) -> int:
        return self.weights.version

    @property
    def mode(self) -> str:
        return self.weights.mode

    # Data path ----------------------------------------------------------------------------
    def _local_shard(self, i: int) -> torch.Tensor:
        v = self._sources[i]
        return v.to_local() if isinstance(v, DTensor) else v

    @torch.no_grad()
    def _fill(self) -> int:
        """Per round: pack strided sends, post every message, copy the local blocks while the
        first round is in flight, wait, unpack strided receives.  Returns the staging bytes."""
        staging = torch.empty(max((r.staging_bytes for r in self._rounds), default=0),
                              dtype=torch.uint8, device=self.device)
        local = [self._local_shard(i) for i in range(len(self.tensors))]
        gen = [self.weights.view(g.name) if g.name in self.weights.tensors else None
               for g, _ in self.tensors]
        for k, rnd in enumerate(self._rounds):
            sends = [(self._wire(m, local[m.block.tensor], m.block.src_box, staging, True),
                      m.peer) for m in rnd.sends]
            recvs = [(self._wire(m, gen[m.block.tensor], m.block.dst_box, staging, False),
                      m.peer) for m in rnd.recvs]
            works = comm.exchange_(sends, recvs, self.group, self.weights.ledger, LABEL)
            if k == 0:
                self._copy_local(local, gen)
            for work in works:
                work.wait()
            for m, (wire, _) in zip(rnd.recvs, recvs):
                if m.staged is not None:
                    dst = _as_bytes(gen[m.block.tensor][_slices(m.block.dst_box)])
                    dst.copy_(wire.view(dst.shape))
        if not self._rounds:
            self._copy_local(local, gen)
        return staging.numel()

    @staticmethod
    def _wire(m: _Message, tensor: torch.Tensor, box: Box, staging: torch.Tensor,
              pack: bool) -> torch.Tensor:
        """The contiguous uint8 tensor that carries ``m``: a view of ``tensor[box]``, or its
        slice of the staging buffer (filled now when sending)."""
        view = _as_bytes(tensor[_slices(box)])
        if m.staged is None:
            return view.reshape(-1)
        wire = staging[m.staged:m.staged + m.block.nbytes]
        if pack:
            wire.view(view.shape).copy_(view)
        return wire

    def _copy_local(self, local: list[torch.Tensor], gen: list[torch.Tensor | None]) -> None:
        for b in self._local:
            gen[b.tensor][_slices(b.dst_box)].copy_(local[b.tensor][_slices(b.src_box)])
