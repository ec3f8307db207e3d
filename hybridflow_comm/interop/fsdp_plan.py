"""Pure maths of the FSDP / ZeRO-3 -> generation transition: boxes, placements, plan, volume.

Nothing here touches torch.distributed: every function maps shapes, a mesh and ranks to boxes
and blocks, so the plan is tested by enumeration without a process.

A *box* is a product of half-open intervals, one per dim, in global tensor coordinates.

Source.  A training mesh (:class:`MeshSpec`) has a data-parallel axis ``dp`` (FSDP: every tensor
``Shard(0)``), optionally a tensor-parallel axis ``tp`` (``Shard(d)`` or ``Replicate``), and any
other axes replicated (HSDP).  Mesh rank ``(i, j)`` (dp, tp coordinates) holds one box of each
tensor::

    dp Shard(0), tp Shard(d != 0):  rows  chunk i of dp  x  dim d chunk j of tp
    dp Shard(0), tp Shard(0):       rows  chunk i * tp + j of dp * tp     (DTensor's order)
    dp _StridedShard(0, sf=tp),     rows  chunk j * dp + i of dp * tp     (FSDP2 over TP,
       tp Shard(0):                                                        torchtitan: the TP
                                                                           shard is outermost)

The distinct boxes of a tensor partition it; each is held by one or more ranks (replicas).

Generation.  A :class:`GenPlacement` gives every rank its ``(pp_g, tp_g)`` coordinate; the
generation shard of TP rank ``t`` of a tensor split on dim ``d`` into ``tp_g`` pieces is one
box, or one box per part for a :class:`ConcatFusion` (``[q | k | v]``), concatenated on dim 0::

    1-D FSDP, 4 ranks -> tp_g = 2, local-first placement (tp_g rank = rank // 2)

    column-parallel [R, C]           row-parallel [R, C]              concat qkv [Q+K+V, C]
    +--------+  r0 -> t0             +----+----+                      +------+ q: t0 | t1
    |  r0    |  r1 -> t0             | r0 | r0 |   t0 needs the left  |      |
    |  r1    |  r2 -> t1             | r1 | r1 |   half of every row: +------+ k: t0 | t1
    |  r2    |  r3 -> t1             | r2 | r2 |   a block from each  +------+ v: t0 | t1
    |  r3    |                       | r3 | r3 |   rank (all-to-all)  +------+
    +--------+                       +----+----+

Plan.  For every rank ``r``, generation box ``b`` and source piece ``P`` (held by ``H``): the
block ``b n P`` is copied locally when ``r`` is in ``H``, else received from
``H[r mod |H|]``.  So the bytes rank ``r`` receives are the minimum::

    recv(r) = sum over tensors X of  e_X * ( |G_r(X)|  -  |G_r(X) n B_r(X)| )

with ``G_r(X)`` the elements of r's generation shard, ``B_r(X)`` those of its FSDP shard and
``e_X`` the element size.  For a 1-D FSDP mesh of ``W`` ranks, ``pp_g = 1`` and the local-first
placement this is (``M_col``: bytes of tensors split on dim 0, ``M_row``: on another dim,
``M_rep``: replicated in generation)::

    recv = (W - t_g) / (t_g W) M_col  +  (W - 1) / (t_g W) M_row  +  (W - 1) / W M_rep

against ``(W - 1) / W M`` for gathering the full state dict on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import Fusion

Box = tuple[tuple[int, int], ...]  # [lo, hi) per dim, global coordinates


def box_numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def intersect(a: Box, b: Box) -> Box | None:
    """``a n b``, or None when empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def shift(box: Box, origin: Sequence[int]) -> Box:
    """``box`` in the coordinates of a tensor whose element 0 sits at ``origin``."""
    return tuple((lo - o, hi - o) for (lo, hi), o in zip(box, origin))


def box_is_contiguous(box: Box, shape: Sequence[int]) -> bool:
    """Whether ``box`` is one contiguous run of a row-major tensor of ``shape``: every dim
    after the first one longer than 1 is whole."""
    ext = [hi - lo for lo, hi in box]
    k = next((d for d, e in enumerate(ext) if e > 1), len(ext))
    return all(e == n for e, n in zip(ext[k + 1:], shape[k + 1:]))


def _chunk(n: int, parts: int, k: int) -> tuple[int, int]:
    size = n // parts
    return k * size, (k + 1) * size


# Source --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeshSpec:
    """The training device mesh, as numbers.

    Attributes:
        shape: size of every mesh axis.
        ranks: global ranks of the mesh in row-major order (``mesh.mesh.flatten()``).
        dp_axis: the FSDP (data-parallel shard) axis.
        tp_axis: the tensor-parallel axis, or None; every other axis is replicated.
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dp_axis: int
    tp_axis: int | None = None

    def __post_init__(self) -> None:
        if math.prod(self.shape) != len(self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"mesh of shape {self.shape} must list {math.prod(self.shape)} "
                             f"distinct ranks, got {self.ranks}")
        axes = [self.dp_axis] + ([] if self.tp_axis is None else [self.tp_axis])
        if any(not 0 <= a < len(self.shape) for a in axes) or self.dp_axis == self.tp_axis:
            raise ValueError(f"dp_axis={self.dp_axis}, tp_axis={self.tp_axis} must be distinct "
                             f"axes of a {len(self.shape)}-D mesh")

    @property
    def dp(self) -> int:
        return self.shape[self.dp_axis]

    @property
    def tp(self) -> int:
        return 1 if self.tp_axis is None else self.shape[self.tp_axis]

    def coord(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of global ``rank``."""
        index = self.ranks.index(rank)
        out = []
        for size in reversed(self.shape):
            out.append(index % size)
            index //= size
        return tuple(reversed(out))

    def dp_tp(self, rank: int) -> tuple[int, int]:
        c = self.coord(rank)
        return c[self.dp_axis], 0 if self.tp_axis is None else c[self.tp_axis]

    def locality_order(self) -> list[int]:
        """Ranks sorted by (tp, dp, other coordinates): the order of their dim-0 chunks under
        FSDP2 over TP, with replicas of one chunk next to each other."""
        def key(rank: int) -> tuple[int, ...]:
            c = self.coord(rank)
            rest = tuple(x for a, x in enumerate(c) if a not in (self.dp_axis, self.tp_axis))
            dp, tp = self.dp_tp(rank)
            return (tp, dp) + rest
        return sorted(self.ranks, key=key)


@dataclass(frozen=True)
class SourcePlacement:
    """How one tensor is cut over a :class:`MeshSpec`.

    Attributes:
        dp_sharded: ``Shard(0)`` on the dp axis (False: replicated there).
        tp_dim: dim split over the tp axis, or None (replicated / no tp axis).
        tp_outer: when both axes cut dim 0, the TP chunk is the outer one (``_StridedShard``).
    """

    dp_sharded: bool
    tp_dim: int | None = None
    tp_outer: bool = False

    def parts(self, mesh: MeshSpec, dim: int) -> int:
        """Into how many equal pieces ``dim`` is cut."""
        n = mesh.dp if self.dp_sharded and dim == 0 else 1
        return n * (mesh.tp if self.tp_dim == dim else 1)

    def box(self, shape: tuple[int, ...], mesh: MeshSpec, rank: int) -> Box:
        """The box that global ``rank`` holds."""
        i, j = mesh.dp_tp(rank)
        out = [(0, n) for n in shape]
        if self.dp_sharded and self.tp_dim == 0:
            k = j * mesh.dp + i if self.tp_outer else i * mesh.tp + j
            out[0] = _chunk(shape[0], mesh.dp * mesh.tp, k)
            return tuple(out)
        if self.dp_sharded:
            out[0] = _chunk(shape[0], mesh.dp, i)
        if self.tp_dim is not None:
            out[self.tp_dim] = _chunk(shape[self.tp_dim], mesh.tp, j)
        return tuple(out)

    def pieces(self, shape: tuple[int, ...], mesh: MeshSpec) -> list[tuple[Box, tuple[int, ...]]]:
        """The distinct boxes (a partition of the tensor) with the ranks holding each."""
        holders: dict[Box, list[int]] = {}
        for rank in mesh.ranks:
            holders.setdefault(self.box(shape, mesh, rank), []).append(rank)
        return [(b, tuple(sorted(h))) for b, h in holders.items()]


# Generation ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConcatFusion:
    """A fused tensor stored as whole parts one after another on dim 0 (``[q | k | v]``,
    ``[gate | up]``, as many checkpoints store them).  The generation shard of TP rank ``t`` is
    the ``t``-th piece of every part, concatenated: ``[q_t | k_t | v_t]`` (several row ranges).

    Attributes:
        part_rows: rows of each part.
        part_units: indivisible units of each part (heads, or rows); ``tp_g`` must divide each.
    """

    part_rows: tuple[int, ...]
    part_units: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.part_rows) != len(self.part_units) or any(
                u < 1 or r % u for r, u in zip(self.part_rows, self.part_units)):
            raise ValueError(f"part_rows={self.part_rows} must hold whole part_units="
                             f"{self.part_units}")

    @classmethod
    def qkv(cls, num_heads: int, num_kv_heads: int, head_dim: int) -> ConcatFusion:
        kv = num_kv_heads * head_dim
        return cls((num_heads * head_dim, kv, kv), (num_heads, num_kv_heads, num_kv_heads))

    @classmethod
    def gate_up(cls, ffn: int) -> ConcatFusion:
        return cls((ffn, ffn), (ffn, ffn))

    def split(self, w):
        """The parts of the full tensor or of any generation shard of it (views)."""
        total = sum(self.part_rows)
        return tuple(w.split([r * w.shape[0] // total for r in self.part_rows], dim=0))


@dataclass(frozen=True)
class GenTensor:
    """One tensor on the generation side.

    Attributes:
        name: state-dict name.
        shape: global shape.
        itemsize: bytes per element.
        dim: dim split over generation TP ranks, or None (replicated).
        stage: generation pipeline stage that holds it.
        fusion: fused layout along dim 0 (QKVFusion / GateUpFusion: whole units, one row range
            per shard; ConcatFusion: one range per part).
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    dim: int | None = None
    stage: int = 0
    fusion: Fusion | ConcatFusion | None = None

    def units(self) -> tuple[int, ...]:
        """The counts ``tp_g`` must divide."""
        if self.dim is None:
            return ()
        if isinstance(self.fusion, ConcatFusion):
            return self.fusion.part_units
        if self.fusion is not None:
            return (self.shape[0] // self.fusion.rows_per_unit,)
        return (self.shape[self.dim],)

    def check(self, tp_g: int) -> None:
        """ValueError unless ``tp_g`` splits this tensor into whole units."""
        if self.fusion is not None and self.dim != 0:
            raise ValueError(f"{self.name}: a fused tensor is split on dim 0 in generation, "
                             f"got dim={self.dim}")
        if isinstance(self.fusion, ConcatFusion) and sum(self.fusion.part_rows) != self.shape[0]:
            raise ValueError(f"{self.name}: ConcatFusion parts {self.fusion.part_rows} do not "
                             f"add up to the {self.shape[0]} rows")
        if self.fusion is not None and not isinstance(self.fusion, ConcatFusion) and \
                self.shape[0] % self.fusion.rows_per_unit:
            raise ValueError(f"{self.name}: {self.shape[0]} rows do not hold whole "
                             f"{type(self.fusion).__name__} units")
        for n in self.units():
            if n % tp_g:
                what = "KV heads / query groups" if self.fusion is not None else f"dim {self.dim}"
                ok = [d for d in range(1, n + 1) if all(u % d == 0 for u in self.units())]
                raise ValueError(f"{self.name}: generation tp_g={tp_g} does not divide its {n} "
                                 f"{what} (shape {self.shape}); choose tp_g from {ok}")

    def boxes(self, tp_g: int, t: int) -> list[Box]:
        """The generation shard of TP rank ``t``, as boxes concatenated on ``dim``."""
        full = [(0, n) for n in self.shape]
        if self.dim is None:
            return [tuple(full)]
        if isinstance(self.fusion, ConcatFusion):
            out, start = [], 0
            for rows in self.fusion.part_rows:
                lo, hi = _chunk(rows, tp_g, t)
                out.append(tuple([(start + lo, start + hi)] + full[1:]))
                start += rows
            return out
        full[self.dim] = _chunk(self.shape[self.dim], tp_g, t)
        return [tuple(full)]

    def shard_shape(self, tp_g: int) -> tuple[int, ...]:
        shape = list(self.shape)
        if self.dim is not None:
            shape[self.dim] //= tp_g
        return tuple(shape)


@dataclass(frozen=True)
class GenPlacement:
    """The generation layout on the training ranks: ``(pp_g, tp_g)`` coordinates by rank.

    Attributes:
        pp_g / tp_g: generation pipeline / tensor-parallel sizes.
        ranks: the global ranks, ascending.
        coords: ``(pp_g rank, tp_g rank)`` of each entry of ``ranks``.
    """

    pp_g: int
    tp_g: int
    ranks: tuple[int, ...]
    coords: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        w = len(self.ranks)
        if self.pp_g < 1 or self.tp_g < 1 or w % (self.pp_g * self.tp_g):
            raise ValueError(f"generation pp_g={self.pp_g} x tp_g={self.tp_g} must divide the "
                             f"{w} ranks of the mesh")
        want = w // (self.pp_g * self.tp_g)
        for s in range(self.pp_g):
            for t in range(self.tp_g):
                if self.coords.count((s, t)) != want:
                    raise ValueError(f"generation coordinate (pp_g={s}, tp_g={t}) is held by "
                                     f"{self.coords.count((s, t))} ranks, expected {want}")

    @classmethod
    def in_order(cls, order: Sequence[int], pp_g: int, tp_g: int) -> GenPlacement:
        """Ranks in ``order`` fill the generation layout tp_g slowest, then pp_g, then dp_g:
        the ``k``-th gets ``tp_g = k // (W / tp_g)``, so a rank holding dim-0 chunk ``k`` of
        ``W`` gets the generation shard containing it (the local-first placement when ``order``
        is :meth:`MeshSpec.locality_order`)."""
        w = len(order)
        if pp_g < 1 or tp_g < 1 or w % (pp_g * tp_g):
            raise ValueError(f"generation pp_g={pp_g} x tp_g={tp_g} must divide the {w} ranks "
                             f"of the mesh")
        per_t, dp_g = w // tp_g, w // (tp_g * pp_g)
        coord = {r: ((k % per_t) // dp_g, k // per_t) for k, r in enumerate(order)}
        ranks = tuple(sorted(order))
        return cls(pp_g, tp_g, ranks, tuple(coord[r] for r in ranks))

    @classmethod
    def from_layout(cls, layout: ParallelLayout | HybridLayout,
                    ranks: Sequence[int]) -> GenPlacement:
        """Coordinates of layout rank ``k`` for ``ranks[k]``: a ParallelLayout ``(pp_g, tp_g,
        dp_g)`` (tp fastest) or a HybridLayout's generation side."""
        ranks = tuple(sorted(ranks))
        if layout.world_size != len(ranks):
            raise ValueError(f"generation layout {layout} covers {layout.world_size} ranks, the "
                             f"mesh has {len(ranks)}")
        if isinstance(layout, HybridLayout):
            coords = [layout.gen_coords(k) for k in range(len(ranks))]
            return cls(layout.pp_g, layout.tp_g, ranks, tuple((c.pp_g, c.tp_g) for c in coords))
        coords = [layout.coords(k) for k in range(len(ranks))]
        return cls(layout.pp, layout.tp, ranks, tuple((c.pp, c.tp) for c in coords))

    def coord(self, rank: int) -> tuple[int, int]:
        return self.coords[self.ranks.index(rank)]

    def tp_groups(self) -> list[list[int]]:
        """Ranks of each generation TP group, in tp_g order (what the engine builds)."""
        by_stage: dict[int, list[list[int]]] = {}
        for s in range(self.pp_g):
            per_t = [[r for r, c in zip(self.ranks, self.coords) if c == (s, t)]
                     for t in range(self.tp_g)]
            by_stage[s] = [list(g) for g in zip(*per_t)]
        return [g for s in range(self.pp_g) for g in by_stage[s]]


# Plan ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """One box of one tensor moving from ``src`` to ``dst`` (a local copy when equal).

    ``src_box`` is in the coordinates of the source's local tensor, ``dst_box`` in those of the
    destination's generation tensor.
    """

    tensor: int
    src: int
    dst: int
    src_box: Box
    dst_box: Box
    nbytes: int


def _dst_origin(gen: GenTensor, boxes: list[Box], index: int) -> list[int]:
    """Where box ``index`` of a generation shard starts in the generation tensor."""
    origin = [lo for lo, _ in boxes[index]]
    d = gen.dim if gen.dim is not None else 0
    origin[d] -= sum(b[d][1] - b[d][0] for b in boxes[:index])
    return origin


def tensor_blocks(index: int, gen: GenTensor, src: SourcePlacement, mesh: MeshSpec,
                  place: GenPlacement, dst: int) -> list[Block]:
    """Every block rank ``dst`` needs of one tensor (local copies included)."""
    s, t = place.coord(dst)
    if gen.stage != s:
        return []
    boxes = gen.boxes(place.tp_g, t)
    out = []
    for piece, holders in src.pieces(gen.shape, mesh):
        origin = [lo for lo, _ in piece]
        for k, b in enumerate(boxes):
            inter = intersect(piece, b)
            if inter is None:
                continue
            sender = dst if dst in holders else holders[dst % len(holders)]
            out.append(Block(index, sender, dst, shift(inter, origin),
                             shift(inter, _dst_origin(gen, boxes, k)),
                             box_numel(inter) * gen.itemsize))
    return out


def plan_blocks(tensors: Sequence[tuple[GenTensor, SourcePlacement]], mesh: MeshSpec,
                place: GenPlacement) -> list[Block]:
    """Every block of the transition, for every rank (the same list on every rank)."""
    return [blk for dst in place.ranks for i, (g, s) in enumerate(tensors)
            for blk in tensor_blocks(i, g, s, mesh, place, dst)]


def min_received_bytes(tensors: Sequence[tuple[GenTensor, SourcePlacement]], mesh: MeshSpec,
                       place: GenPlacement, rank: int) -> int:
    """``sum_X e_X (|G_r(X)| - |G_r(X) n B_r(X)|)`` (module docstring), from the boxes alone."""
    s, t = place.coord(rank)
    total = 0
    for gen, src in tensors:
        if gen.stage != s:
            continue
        mine = src.box(gen.shape, mesh, rank)
        for b in gen.boxes(place.tp_g, t):
            inter = intersect(b, mine)
            total += (box_numel(b) - (box_numel(inter) if inter else 0)) * gen.itemsize
    return total


def _split(block: Block, cap: int) -> list[Block]:
    """Cut a block larger than ``cap`` bytes along its first dim longer than 1."""
    if block.nbytes <= cap:
        return [block]
    ext = [hi - lo for lo, hi in block.src_box]
    d = next((i for i, n in enumerate(ext) if n > 1), None)
    if d is None:
        return [block]
    step = max(1, cap // (block.nbytes // ext[d]))
    out = []
    for a in range(0, ext[d], step):
        b = min(ext[d], a + step)

        def cut(box: Box) -> Box:
            return box[:d] + ((box[d][0] + a, box[d][0] + b),) + box[d + 1:]

        out.append(Block(block.tensor, block.src, block.dst, cut(block.src_box),
                         cut(block.dst_box), block.nbytes // ext[d] * (b - a)))
    return out


def plan_rounds(blocks: Sequence[Block], pair_bytes: int) -> list[list[Block]]:
    """Remote blocks cut into rounds: in each round every (src, dst) pair moves at most
    ``pair_bytes`` (one block longer than that in its own round).  Order within a pair is kept,
    so every rank derives the same rounds from the same plan."""
    by_pair: dict[tuple[int, int], list[Block]] = {}
    for blk in blocks:
        if blk.src != blk.dst:
            for piece in _split(blk, pair_bytes):
                by_pair.setdefault((blk.src, blk.dst), []).append(piece)
    rounds: list[list[Block]] = []
    for pair in sorted(by_pair):
        k, fill = 0, 0
        for blk in by_pair[pair]:
            if fill and fill + blk.nbytes > pair_bytes:
                k, fill = k + 1, 0
            while len(rounds) <= k:
                rounds.append([])
            rounds[k].append(blk)
            fill += blk.nbytes
    return rounds
