"""NCCL's rules, enforced on gloo: a debug wrapper around torch.distributed's calls.

gloo accepts what NCCL refuses (strided tensors, tags, host tensors in a device group, p2p on a
communicator nobody initialised, gloo-only ops), so a CPU test suite can pass while the same
code fails on GPUs.  :func:`install` replaces the collective and point-to-point functions of
the ``torch.distributed`` namespace (what the code under test calls) by checks that raise
:class:`NcclRuleError` before the real call::

    contiguous      every tensor of a call is contiguous
    one device      every tensor is on the groups' declared device (``device``: cpu in CPU
                    tests, so meta or a second device is refused, as host tensors are in NCCL)
    one dtype       the tensors of one collective share a dtype
    sizes           all_gather_single output = world x input, reduce_scatter_tensor input =
                    world x output, all_gather list entries equal to the input
    tags            point-to-point tag 0 (NCCL matches messages by order)
    no any-source   recv/irecv name their source
    warm-up         no point-to-point on a group before a collective on it
    NCCL has it     monitored_barrier, all_gather_coalesced refused
    same call       with ``cross_check``, the ranks of each collective first compare
                    (op, numel, dtype) over the group: uneven per-rank sizes or two different
                    collectives paired up raise on every rank instead of hanging

Calls torch makes inside its own functions (``all_gather_object``'s gathers) are not seen.

In a job script (every rank, before its first collective)::

    from hybridflow_comm import nccl_rules
    nccl_rules.install("cpu")

or run a script or module under the rules: ``torchrun ... -m hybridflow_comm.nccl_rules SCRIPT
ARGS`` / ``torchrun ... -m hybridflow_comm.nccl_rules -m MODULE ARGS``.
``HYBRIDFLOW_TEST_NCCL_RULES=1`` makes :func:`install_from_env` (called by the test rank pools
and the job modules) install it, and the RL runtime's ranks install it at start
(:func:`rlhf.controller.launch.hooks_of_test_modes`).  The test suite runs its multi-rank
checks under it; a run never installs it unless asked to.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

import torch
import torch.distributed as dist

ENV = "HYBRIDFLOW_TEST_NCCL_RULES"
_DTYPES = {d: i for i, d in enumerate(
    (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
     torch.int16, torch.int32, torch.int64, torch.bool))}


class NcclRuleError(RuntimeError):
    """A call that NCCL would refuse (or hang on)."""


class Rules:
    """The state of the installed rules: declared device, warmed groups, counts."""

    def __init__(self, device: str | torch.device, cross_check: bool) -> None:
        self.device = torch.device(device)
        self.cross_check = cross_check
        self.warm: set = set()
        self.calls = 0
        self.originals: dict[str, object] = {}

    # Checks ---------------------------------------------------------------------------------
    def tensors(self, op: str, tensors: list[torch.Tensor], one_dtype: bool = True) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise NcclRuleError(f"{op}: {type(t).__name__} is not a tensor")
            if not t.is_contiguous():
                raise NcclRuleError(f"{op}: non-contiguous tensor (shape {tuple(t.shape)}, "
                                    f"stride {t.stride()}): NCCL takes contiguous tensors only")
            if not _same_device(t.device, self.device):
                raise NcclRuleError(f"{op}: tensor on {t.device} in a group for "
                                    f"{self.device} (NCCL takes no host or foreign tensors)")
        dtypes = {t.dtype for t in tensors}
        if one_dtype and len(dtypes) > 1:
            raise NcclRuleError(f"{op}: mixed dtypes {sorted(map(str, dtypes))} in one call")

    def collective(self, op: str, group, numel: int, dtype: torch.dtype) -> None:
        """Mark ``group`` warm; with ``cross_check``, compare the call across its ranks."""
        self.calls += 1
        key = _key(group)
        self.warm.add(key)
        # Inside a coalescing block a collective only queues: the comparison would be queued.
        if not self.cross_check or _group_size(group) == 1 or _coalescing(group):
            return
        mine = torch.tensor([_op_id(op), numel, _DTYPES.get(dtype, -1)], dtype=torch.int64,
                            device=self.device)
        table = torch.empty(dist.get_world_size(group) * 3, dtype=torch.int64, device=self.device)
        self.originals["all_gather_single"](table, mine, group=group)
        table = table.view(-1, 3)
        if not bool((table == table[0]).all()):
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            raise NcclRuleError(f"{op}: the ranks {ranks} of the group disagree on (op id, "
                                f"numel, dtype id): {table.tolist()} (NCCL would hang or "
                                f"corrupt)")

    def p2p(self, op: str, tensor: torch.Tensor, peer, group, tag: int) -> None:
        self.calls += 1
        self.tensors(op, [tensor])
        if tag != 0:
            raise NcclRuleError(f"{op}: tag={tag}; NCCL has no tags (messages between two "
                                f"ranks match by order): use tag 0")
        if peer is None:
            raise NcclRuleError(f"{op}: no peer rank; NCCL cannot receive from any source")
        if _key(group) not in self.warm:
            raise NcclRuleError(f"{op}: point-to-point on a group before any collective on "
                                f"it: run one collective on the group first (warm-up)")


_RULES: Rules | None = None


def _key(group):
    return "WORLD" if group is None or group is dist.group.WORLD else group


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _op_id(op: str) -> int:
    return sum(ord(c) * 31 ** i for i, c in enumerate(op)) % (1 << 31)


def _group_size(group) -> int:
    return dist.get_world_size(group)


# What each function's arguments must satisfy ------------------------------------------------
def _check_world_parts(r: Rules, op: str, group, whole: tuple[str, torch.Tensor],
                       part: tuple[str, torch.Tensor]) -> None:
    """A single-tensor gather or scatter: the whole tensor is world x the per-rank part."""
    (whole_name, big), (part_name, small) = whole, part
    r.tensors(op, [big, small])
    if big.numel() != _group_size(group) * small.numel():
        raise NcclRuleError(f"{op}: {whole_name} has {big.numel()} elements, world x "
                            f"{part_name} is {_group_size(group)} x {small.numel()}")
    r.collective(op, group, small.numel(), small.dtype)


def _check_all_gather_single(r: Rules, op: str, a: dict) -> None:
    _check_world_parts(r, op, a["group"], ("output", a["output_tensor"]),
                       ("input", a["input_tensor"]))


def _check_reduce_scatter_tensor(r: Rules, op: str, a: dict) -> None:
    _check_world_parts(r, op, a["group"], ("input", a["input"]), ("output", a["output"]))


def _check_all_gather(r: Rules, op: str, a: dict) -> None:
    outs, inp, group = a["tensor_list"], a["tensor"], a["group"]
    r.tensors(op, list(outs) + [inp])
    uneven = [tuple(t.shape) for t in outs if t.numel() != inp.numel()]
    if uneven or len(outs) != _group_size(group):
        raise NcclRuleError(f"{op}: {len(outs)} outputs of shapes {[tuple(t.shape) for t in outs]}"
                            f" for input {tuple(inp.shape)} in a group of {_group_size(group)}: "
                            f"NCCL gathers equal parts")
    r.collective(op, group, inp.numel(), inp.dtype)


def _check_one_tensor(r: Rules, op: str, a: dict) -> None:
    t = a["tensor"]
    r.tensors(op, [t])
    r.collective(op, a["group"], t.numel(), t.dtype)


def _check_all_to_all_single(r: Rules, op: str, a: dict) -> None:
    out, inp = a["output"], a["input"]
    r.tensors(op, [out, inp])
    even = a["output_split_sizes"] is None and a["input_split_sizes"] is None
    if even and out.numel() != inp.numel():
        raise NcclRuleError(f"{op}: output has {out.numel()} elements, input {inp.numel()}")
    r.collective(op, a["group"], inp.numel() if even else -1, inp.dtype)


def _check_all_to_all(r: Rules, op: str, a: dict) -> None:
    r.tensors(op, list(a["output_tensor_list"]) + list(a["input_tensor_list"]))
    r.collective(op, a["group"], -1, a["input_tensor_list"][0].dtype)


def _check_barrier(r: Rules, op: str, a: dict) -> None:
    r.collective(op, a["group"], 0, torch.int64)


def _check_send(r: Rules, op: str, a: dict) -> None:
    peer = a.get("dst", a.get("src"))
    peer = peer if peer is not None else a.get("group_dst", a.get("group_src"))
    r.p2p(op, a["tensor"], peer, a["group"], a["tag"])


def _check_batch(r: Rules, op: str, a: dict) -> None:
    ops = a["p2p_op_list"]
    r.tensors(op, [p.tensor for p in ops], one_dtype=False)
    for p in ops:
        r.p2p(op, p.tensor, p.peer, p.group, p.tag)


def _refuse(r: Rules, op: str, a: dict) -> None:
    raise NcclRuleError(f"{op}: NCCL has no {op} (gloo only)")


_CHECKS = {
    "all_gather_single": _check_all_gather_single,
    "all_gather_into_tensor": _check_all_gather_single,
    "reduce_scatter_tensor": _check_reduce_scatter_tensor,
    "all_gather": _check_all_gather,
    "all_reduce": _check_one_tensor,
    "broadcast": _check_one_tensor,
    "reduce": _check_one_tensor,
    "all_to_all_single": _check_all_to_all_single,
    "all_to_all": _check_all_to_all,
    "barrier": _check_barrier,
    "send": _check_send,
    "recv": _check_send,
    "isend": _check_send,
    "irecv": _check_send,
    "batch_isend_irecv": _check_batch,
    "monitored_barrier": _refuse,
    "all_gather_coalesced": _refuse,
}
# P2POp checks its op against distributed_c10d's isend/irecv: those are replaced there too.
_BOTH_NAMESPACES = ("isend", "irecv")


def _wrap(name: str, original):
    import inspect

    signature = inspect.signature(original)
    check = _CHECKS[name]

    @functools.wraps(original)
    def checked(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if _RULES is not None:
            check(_RULES, name, bound.arguments)
        return original(*args, **kwargs)

    checked.nccl_rules_original = original
    return checked


def _coalescing(group) -> bool:
    state = getattr(dist.distributed_c10d._world, "pg_coalesce_state", None)
    if not state:
        return False
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg in state


def install(device: str | torch.device = "cpu", cross_check: bool = True) -> Rules:
    """Enforce NCCL's rules on this process's torch.distributed calls from now on.

    Args:
        device: the device every group is for (cpu in CPU tests); tensors elsewhere are
            refused.
        cross_check: before each collective, compare (op, numel, dtype) across the group's
            ranks (one extra small all-gather per collective).

    Returns:
        The installed :class:`Rules` (its ``calls`` counts the checked calls).  Installing
        again replaces the device and settings.  The resharders' host path (point-to-point
        messages for gloo) is switched to the device path, so the code NCCL runs is what runs.
    """
    global _RULES
    from hybridflow_comm import comm

    rules = Rules(device, cross_check)
    c10d = dist.distributed_c10d
    for name in _CHECKS:
        if not hasattr(dist, name):
            continue
        current = getattr(dist, name)
        original = getattr(current, "nccl_rules_original", current)
        rules.originals[name] = original
        wrapped = _wrap(name, original)
        setattr(dist, name, wrapped)
        if name in _BOTH_NAMESPACES:
            setattr(c10d, name, wrapped)
    rules.originals.setdefault("all_gather_single", rules.originals.get("all_gather_into_tensor"))
    comm.TORCH.host_p2p = False
    _RULES = rules
    return rules


def uninstall() -> None:
    """Put torch.distributed's own functions back."""
    global _RULES
    from hybridflow_comm import comm

    if _RULES is None:
        return
    for name, original in _RULES.originals.items():
        if hasattr(dist, name):
            setattr(dist, name, original)
        if name in _BOTH_NAMESPACES:
            setattr(dist.distributed_c10d, name, original)
    comm.TORCH.host_p2p = True
    _RULES = None


def installed() -> Rules | None:
    """The installed :class:`Rules` (None when the rules are not installed)."""
    return _RULES


def install_from_env(device: str | torch.device = "cpu") -> Rules | None:
    """:func:`install` when ``HYBRIDFLOW_TEST_NCCL_RULES=1``; else nothing."""
    return install(device) if os.environ.get(ENV) == "1" else None


def main(argv: list[str]) -> None:
    """``python -m hybridflow_comm.nccl_rules [-m MODULE | SCRIPT] ARGS...`` under the rules (cpu)."""
    if not argv:
        raise SystemExit("usage: python -m hybridflow_comm.nccl_rules [-m MODULE | SCRIPT] [ARGS...]")
    install("cpu")
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
