"""The one instrumented path for every collective of the toolkit.

Each call records, for this rank, the payload bytes it sends and receives, counted as if the
collective moved data directly between members (the algorithm the backend picks does not
change the count): an all-gather of ``S`` bytes per member over ``n`` members sends and
receives ``(n - 1) * S``; a broadcast of ``S`` bytes receives ``S`` on every non-root and sends
``(n - 1) * S`` from the root.  Groups of one rank skip the collective and record nothing.

The data movement itself goes through a backend: ``TorchBackend`` (torch.distributed on the
group's ProcessGroup: gloo here, NCCL on GPUs) by default, or any object with the same four
methods.

Every call keeps to NCCL's rules, so one code path serves both backends: tensors contiguous,
of one device and dtype per call, on the device the group computes on (never host tensors in
a device collective); all-gathers of equal parts; point-to-point messages matched by their
order between two members (tag 0: NCCL has no tags); a collective on a group before its first
point-to-point message (every user of :func:`exchange_` agrees on specs first, which is that
collective).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from hybridflow_comm.groups import Group


@dataclass
class CommLedger:
    """Bytes and calls of this rank, per label (e.g. ``"reshard"``, ``"meta"``)."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, label: str, sent: int, received: int) -> None:
        self.sent[label] += sent
        self.received[label] += received
        self.calls[label] += 1

    def snapshot(self, label: str) -> tuple[int, int, int]:
        """``(sent, received, calls)`` recorded so far under ``label``."""
        return self.sent[label], self.received[label], self.calls[label]


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, pg) -> None:
    """``all_gather_single`` (``all_gather_into_tensor`` before torch renamed it), looked up
    at each call so that a wrapper installed on ``torch.distributed`` sees it."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=pg)


class Backend(Protocol):
    """How bytes move for a group (the ledger counts them either way)."""

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, group: Group) -> None: ...

    def all_gather_regions(self, regions: list[torch.Tensor], group: Group) -> None: ...

    def all_gather_views(self, outputs: list[torch.Tensor], group: Group) -> None: ...

    def broadcast_(self, tensor: torch.Tensor, root: int, group: Group) -> None: ...


class TorchBackend:
    """torch.distributed on the group's ProcessGroup.

    Device tensors (NCCL) take the collectives: one in-place ``all_gather_single`` per region,
    the regions of one call coalesced into one launch (:meth:`all_gather_regions`).

    Host tensors (gloo), with ``host_p2p`` (the default), take point-to-point messages
    straight between the caller's memory instead: ``all_gather`` / ``all_gather_single`` on
    gloo stage every call (the input flattened, the output received into a fresh ``[n, S]``
    tensor and copied out), and that fresh tensor, ``mmap`` ed above glibc's 32 MiB threshold,
    is faulted in page by page on every call, which at large buckets dominates a transition's
    time (``sys_s`` of ``bench/transition.py --size-mb 1024`` shows it).  gloo's
    ``send``/``recv`` use the tensor's own memory, so each contiguous piece is one message, all
    posted at once.  ``host_p2p=False`` runs host tensors through the device path too (what
    the NCCL-rule tests check on CPU).
    """

    def __init__(self, host_p2p: bool = True) -> None:
        self.host_p2p = host_p2p

    def _p2p(self, t: torch.Tensor) -> bool:
        return self.host_p2p and t.device.type == "cpu"

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
        inp = inp.contiguous().view(-1)
        if not self._p2p(out):
            _all_gather_flat(out, inp, group.pg)
            return
        n = inp.numel()
        chunks = [out[k * n:(k + 1) * n] for k in range(group.size)]
        if chunks[group.rank].data_ptr() != inp.data_ptr():
            chunks[group.rank].copy_(inp)
        _exchange_pieces([[inp]] * group.size, [[c] for c in chunks], group)

    def all_gather_regions(self, regions: list[torch.Tensor], group: Group) -> None:
        """Gather every region (1-D, ``[n * part]``, own part in place) in one launch."""
        parts = [r.chunk(group.size) for r in regions]
        if self._p2p(regions[0]):
            _exchange_pieces([[p[group.rank] for p in parts]] * group.size,
                             [[p[k] for p in parts] for k in range(group.size)], group)
            return
        with dist._coalescing_manager(group.pg, async_ops=True) as cm:
            for region, part in zip(regions, parts):
                _all_gather_flat(region, part[group.rank], group.pg)
        cm.wait()

    def all_gather_views(self, outputs: list[torch.Tensor], group: Group) -> None:
        mine = outputs[group.rank]
        rows = [_contiguous_rows(v) for v in outputs]
        if self._p2p(mine) and all(r is not None for r in rows):
            _exchange_pieces([rows[group.rank]] * group.size, rows, group)
            return
        # One contiguous gather, then copied out: NCCL takes no strided tensors.
        flat = torch.empty((group.size, mine.numel()), dtype=mine.dtype, device=mine.device)
        flat[group.rank].view(mine.shape).copy_(mine)
        _all_gather_flat(flat.view(-1), flat[group.rank], group.pg)
        for k, view in enumerate(outputs):
            if k != group.rank:
                view.copy_(flat[k].view(view.shape))

    def broadcast_(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        dist.broadcast(tensor, src=group.ranks[root], group=group.pg)


def _exchange_pieces(sends: list[list[torch.Tensor]], recvs: list[list[torch.Tensor]],
                     group: Group) -> None:
    """Send ``sends[k][i]`` to member ``k`` and receive ``recvs[k][i]`` from it, for every
    other member ``k``, all posted at once (matched by their order between two members, tag 0);
    waits for all of them."""
    ops = []
    for k, peer in enumerate(group.ranks):
        if k == group.rank:
            continue
        for mine, theirs in zip(sends[k], recvs[k], strict=True):
            if mine.numel() == 0:
                continue
            ops.append(dist.P2POp(dist.isend, mine, peer, group.pg))
            ops.append(dist.P2POp(dist.irecv, theirs, peer, group.pg))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


TORCH = TorchBackend()


def _contiguous_rows(view: torch.Tensor) -> list[torch.Tensor] | None:
    """``view`` as contiguous 1-D pieces in order (itself, or its dim-0 rows); None when a row
    is not contiguous."""
    if view.is_contiguous():
        pieces = [view.reshape(-1)]
    elif view.dim() >= 2 and view[0].is_contiguous():
        pieces = [row.reshape(-1) for row in view.unbind(0)]
    else:
        return None
    return pieces


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Group,
                    ledger: CommLedger | None = None, label: str = "",
                    backend: Backend = TORCH) -> None:
    """``out[k * inp.numel():(k + 1) * inp.numel()] = inp of member k`` (``out`` 1-D).

    Bytes are recorded under ``label`` when a ledger is given (the toolkit always gives one).
    """
    n = group.size
    if out.numel() != n * inp.numel():
        raise ValueError(f"all_gather_into: out has {out.numel()} elements, expected "
                         f"{n} x {inp.numel()}")
    if n == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp.reshape(-1))
        return
    backend.all_gather_into(out, inp, group)
    if ledger is not None:
        ledger.record(label, (n - 1) * inp.nbytes, (n - 1) * inp.nbytes)


def all_gather_views(outputs: list[torch.Tensor], group: Group, ledger: CommLedger,
                     label: str, backend: Backend = TORCH) -> None:
    """``outputs[k] = outputs[k] of member k`` for views of any strides; the own view is the
    input.  Views of a flat buffer whose rows are contiguous (the resharder's buckets) move
    with no staging at all on the torch backend (see :meth:`TorchBackend.all_gather_views`)."""
    n = group.size
    if len(outputs) != n:
        raise ValueError(f"all_gather_views: {len(outputs)} outputs for a group of {n}")
    mine = outputs[group.rank]
    odd = [(k, tuple(v.shape), v.dtype) for k, v in enumerate(outputs)
           if v.shape != mine.shape or v.dtype != mine.dtype]
    if odd:
        raise ValueError(f"all_gather_views: outputs (member, shape, dtype) {odd} differ from "
                         f"the own view's {tuple(mine.shape)}, {mine.dtype}")
    if n == 1:
        return
    backend.all_gather_views(outputs, group)
    nbytes = outputs[group.rank].numel() * outputs[group.rank].element_size()
    ledger.record(label, (n - 1) * nbytes, (n - 1) * nbytes)


def all_gather_regions(regions: list[torch.Tensor], group: Group, ledger: CommLedger,
                       label: str, backend: Backend = TORCH) -> None:
    """In-place all-gather of each region, all in one launch where the backend can.

    Each region is a contiguous 1-D ``[n * part]`` tensor holding this member's part in place
    at ``[rank * part, (rank + 1) * part)`` (a resharder's ``[m, slot]`` generation region);
    afterwards part ``k`` is member ``k``'s.  One call is recorded, with the bytes of every
    region.
    """
    n = group.size
    bad = [(i, r.numel(), r.is_contiguous(), r.dtype, str(r.device))
           for i, r in enumerate(regions) if r.dim() != 1 or r.numel() % n
           or not r.is_contiguous() or (r.dtype, r.device) != (regions[0].dtype, regions[0].device)]
    if bad:
        raise ValueError(f"all_gather_regions: regions (index, numel, contiguous, dtype, device) "
                         f"{bad} are not contiguous 1-D, of {n} equal parts, of one dtype and "
                         f"device")
    if n == 1 or not regions:
        return
    backend.all_gather_regions(regions, group)
    nbytes = sum(r.nbytes for r in regions) // n
    ledger.record(label, (n - 1) * nbytes, (n - 1) * nbytes)


def broadcast_(tensor: torch.Tensor, root: int, group: Group, ledger: CommLedger,
               label: str, backend: Backend = TORCH) -> None:
    """Broadcast ``tensor`` in place from group rank ``root``."""
    n = group.size
    if n == 1:
        return
    backend.broadcast_(tensor, root, group)
    if group.rank == root:
        ledger.record(label, (n - 1) * tensor.nbytes, 0)
    else:
        ledger.record(label, 0, tensor.nbytes)


def all_gather_tensor(inp: torch.Tensor, group: Group, ledger: CommLedger | None = None,
                      label: str = "") -> torch.Tensor:
    """``[n, *inp.shape]`` stack of every member's ``inp``, in group-rank order (a view of
    ``inp`` for a group of one)."""
    if group.size == 1:
        return inp.unsqueeze(0)
    out = torch.empty((group.size * inp.numel(),), dtype=inp.dtype, device=inp.device)
    all_gather_into(out, inp.contiguous().reshape(-1), group, ledger, label)
    return out.view(group.size, *inp.shape)


def all_reduce_max(value: int, group: Group, ledger: CommLedger, label: str,
                   device: torch.device | str = "cpu") -> int:
    """Max of an int over the group, reduced on ``device`` (the group's device; the result is
    read back on the host, which is what the caller branches on)."""
    if group.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    ledger.record(label, (group.size - 1) * 8, (group.size - 1) * 8)
    return int(t.item())


def all_gather_object(obj: object, group: Group, ledger: CommLedger, label: str) -> list:
    """Every member's picklable ``obj`` (used only on error paths and for metadata)."""
    if group.size == 1:
        return [obj]
    out: list = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    ledger.record(label, 0, 0)
    return out


def exchange_(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
              group: Group, ledger: CommLedger, label: str) -> list:
    """Post point-to-point sends ``(tensor, group rank)`` and receives (into the tensors, in
    place) all at once (``batch_isend_irecv``); returns the works to wait on.

    Tensors must be contiguous.  Messages between two members are matched in posting order
    (tag 0: NCCL has no tags), so both sides post them in one agreed order.  NCCL also wants a
    collective on the group before its first point-to-point message; callers agree on their
    specs over the group first, which is that collective.  Bytes recorded are the payloads.
    """
    if not sends and not recvs:
        return []
    if group.size == 1:
        raise ValueError("exchange_: point-to-point messages in a group of one")
    ops = [dist.P2POp(kind, tensor, group.ranks[peer], group.pg)
           for kind, items in ((dist.isend, sends), (dist.irecv, recvs))
           for tensor, peer in items]
    works = dist.batch_isend_irecv(ops)
    ledger.record(label, sum(t.nbytes for t, _ in sends), sum(t.nbytes for t, _ in recvs))
    return works
