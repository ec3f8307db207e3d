"""Controller programs that the controller tests start under torchrun (4 ranks).

    torchrun --standalone --nproc_per_node 4 -m tests.controller_jobs checks OUT.json
    torchrun --standalone --nproc_per_node 4 -m tests.controller_jobs raise
    torchrun --standalone --nproc_per_node 4 -m tests.controller_jobs kill PIDFILE
    torchrun --standalone --nproc_per_node N -m tests.controller_jobs stall PIDFILE RANK
    torchrun --standalone --nproc_per_node 4 -m tests.controller_jobs intruders OUT.json MARKER

``checks`` runs every multi-rank check in one job and writes ``{name: {"got", "expected"}}``;
the expectations come from direct loops over the layout maths of hybridflow_comm.layout, never
from the C++ plans under test.  ``intruders``: strangers attack the controller's port during
the start-up and during the job (see :func:`_intruders`).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import struct
import sys
import time

import torch

from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.controller import (ALL_TO_ALL, DP_COMPUTE, DP_PROTO, ONE_TO_ALL, THREE_D_PROTO,
                             Batch, Controller, Plan, Worker, WorkerError,
                             protocol, register_protocol, run)
from rlhf.controller import handshake, rendezvous
from rlhf.controller.messages import Hello
from rlhf.controller.protocols import CONCAT, SPLIT

N_ROWS = 7  # uneven on purpose: padding must be added and removed again
WIDE = 1 << 16  # floats per row of the wide payload (256 KiB per row)

# A user protocol: split over ranks in reverse order, concatenated in reverse order.
REVERSED = register_protocol(
    "JOBS_REVERSED", lambda layout: Plan(SPLIT, layout.world_size,
                                         tuple(reversed(range(layout.world_size))),
                                         tuple(reversed(range(layout.world_size))), CONCAT))


class Probe(Worker):
    """Records the rows it receives; returns them tagged with its global rank."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset
        self.seen: list[int] | None = None

    def _echo(self, batch: Batch | None = None) -> Batch | tuple:
        self.seen = batch["idx"].tolist() if batch is not None else []
        if batch is None:
            return (self.global_rank, [])
        return Batch({"idx": batch["idx"], "rank": torch.full((len(batch),), self.global_rank)})

    @protocol("ONE_TO_ALL")
    def echo_one_to_all(self, batch: Batch | None = None):
        return self._echo(batch), self.global_rank

    @protocol("3D_PROTO")
    def echo_3d_proto(self, batch: Batch) -> Batch:
        return self._echo(batch)

    @protocol("3D_ALL_MICRO_DP")
    def echo_3d_all_micro_dp(self, batch: Batch) -> Batch:
        return self._echo(batch)

    @protocol("3D_PP_ONLY")
    def echo_3d_pp_only(self, batch: Batch):
        return self._echo(batch), self.global_rank

    @protocol("DP_PROTO")
    def echo_dp_proto(self, batch: Batch) -> Batch:
        return self._echo(batch)

    @protocol("ALL_TO_ALL")
    def echo_all_to_all(self, batch: Batch):
        return self._echo(batch), self.global_rank

    @protocol("DP_COMPUTE_METRIC")
    def echo_dp_compute_metric(self, batch: Batch):
        return self._echo(batch).tensors["idx"].tolist(), self.global_rank

    @protocol("RANK_ZERO")
    def echo_rank_zero(self, batch: Batch):
        return self._echo(batch).tensors["idx"].tolist(), self.global_rank

    @protocol("JOBS_REVERSED")
    def echo_reversed(self, batch: Batch) -> Batch:
        return self._echo(batch)

    @protocol(DP_COMPUTE)
    def square(self, item: int) -> tuple:
        return self.global_rank, item * item

    @protocol(ALL_TO_ALL)
    def take_seen(self) -> tuple:
        seen, self.seen = self.seen, None
        return self.global_rank, seen

    @protocol(THREE_D_PROTO)
    def scale(self, batch: Batch) -> Batch:
        # SPMD inside the role: the TP group agrees on the result by an all-reduce.
        x = batch["x"] * 2 + self.offset
        tp = self.groups.train_tp
        if tp.pg is not None:
            summed = x.clone()
            torch.distributed.all_reduce(summed, group=tp.pg)
            assert torch.equal(summed, x * tp.size)
        return Batch({"x": x, "idx": batch["idx"]})

    @protocol(DP_PROTO)
    def add_one(self, batch: Batch) -> Batch:
        self.seen = batch["idx"].tolist()
        return Batch({"x": batch["x"] + 1, "idx": batch["idx"],
                      "by": torch.full((len(batch),), self.global_rank)})

    @protocol(DP_PROTO)
    def fail_on_rank_2(self, batch: Batch | None = None) -> None:
        if self.global_rank == 2:
            raise RuntimeError("deliberate failure on rank 2")

    @protocol(ONE_TO_ALL)
    def sleep_on_rank(self, target: int, pid_file: str) -> None:
        if self.global_rank == target:
            with open(pid_file, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)

    @protocol(ONE_TO_ALL)
    def unmatched_all_reduce(self) -> None:
        # Only layout rank 1 enters the TP collective: it must time out, not hang.
        if self.rank == 1:
            torch.distributed.all_reduce(torch.ones(1), group=self.groups.train_tp.pg)

    @protocol(ONE_TO_ALL)
    def knock(self, marker: str) -> dict | None:
        """Rank 1 attacks the controller's port during the job; the strangers' report."""
        if self.global_rank != 1:
            return None
        return _STRANGERS | {"during_job": _attack(_STRANGERS["host"], _STRANGERS["port"],
                                                   marker)}

    def not_a_worker_method(self) -> None:
        pass


def _layout(train, gen=(1, 1)) -> HybridLayout:
    return HybridLayout(ParallelLayout(*train), pp_g=gen[0], tp_g=gen[1])


def expected_seen(name: str, layout: HybridLayout, n: int) -> dict[int, list[int]]:
    """Rows each layout rank receives, by a direct loop over layout.py."""
    t, w = layout.train, layout.world_size
    if name in ("ONE_TO_ALL", "ALL_TO_ALL", "3D_PP_ONLY"):
        return {r: list(range(n)) for r in range(w)}
    if name == "RANK_ZERO":
        return {0: list(range(n))}
    if name == "3D_PROTO":
        chunk, k = {r: t.coords(r).dp for r in range(w)}, t.dp
    elif name == "3D_ALL_MICRO_DP":
        groups = layout.micro_dp_groups()
        chunk = {r: next(i for i, g in enumerate(groups) if r in g) for r in range(w)}
        k = len(groups)
    elif name in ("DP_PROTO", "DP_COMPUTE_METRIC"):
        chunk, k = {r: r for r in range(w)}, w
    elif name == "JOBS_REVERSED":
        chunk, k = {r: w - 1 - r for r in range(w)}, w
    else:
        raise AssertionError(name)
    size = -(-n // k)
    return {r: [i % n for i in range(c * size, (c + 1) * size)] for r, c in chunk.items()}


def _seen(group) -> dict[int, list[int]]:
    return {r: s for r, s in group.take_seen().get() if s is not None}


def check_protocols(ctl: Controller, out: dict) -> None:
    layouts = {"1-2-2": _layout((1, 2, 2)), "2-2-1/g1-2": _layout((2, 2, 1), (1, 2)),
               "2-1-2": _layout((2, 1, 2)), "1-4-1/g1-2": _layout((1, 4, 1), (1, 2))}
    batch = Batch({"idx": torch.arange(N_ROWS)})
    methods = {"ONE_TO_ALL": Probe.echo_one_to_all, "3D_PROTO": Probe.echo_3d_proto,
               "3D_ALL_MICRO_DP": Probe.echo_3d_all_micro_dp,
               "3D_PP_ONLY": Probe.echo_3d_pp_only, "DP_PROTO": Probe.echo_dp_proto,
               "ALL_TO_ALL": Probe.echo_all_to_all,
               "DP_COMPUTE_METRIC": Probe.echo_dp_compute_metric,
               "RANK_ZERO": Probe.echo_rank_zero, "JOBS_REVERSED": Probe.echo_reversed}
    for lname, layout in layouts.items():  # colocated: four roles on the same four ranks
        group = ctl.group(Probe, layout, name=f"probe[{lname}]")
        for pname, method in methods.items():
            result = group.call(method, batch).get()
            seen = _seen(group)
            out[f"seen/{pname}/{lname}"] = {"got": seen,
                                            "expected": expected_seen(pname, layout, N_ROWS)}
            out[f"result/{pname}/{lname}"] = {"got": _describe(result),
                                              "expected": _expected_result(pname, layout)}


def _describe(result) -> object:
    if isinstance(result, Batch):
        return {"idx": result["idx"].tolist(), "rank": result["rank"].tolist()}
    if isinstance(result, list):
        return [_describe(r) for r in result]
    if isinstance(result, tuple):
        return [_describe(r) for r in result]
    return result


def _expected_result(pname: str, layout: HybridLayout) -> object:
    """Collected result, by direct loops: who answers, in which order, which rows."""
    t, w, n = layout.train, layout.world_size, N_ROWS
    seen = expected_seen(pname, layout, n)
    if pname in ("ONE_TO_ALL", "ALL_TO_ALL"):
        return [[{"idx": seen[r], "rank": [r] * n}, r] for r in range(w)]
    if pname == "3D_PP_ONLY":
        return [[{"idx": seen[r], "rank": [r] * n}, r]
                for r in (t.rank(pp=s, tp=0, dp=0) for s in range(t.pp))]
    if pname == "RANK_ZERO":
        return [list(range(n)), 0]
    if pname == "DP_COMPUTE_METRIC":
        return [[seen[r], r] for r in range(w)]
    if pname == "3D_PROTO":
        order = [t.rank(pp=t.pp - 1, tp=0, dp=d) for d in range(t.dp)]
    elif pname == "3D_ALL_MICRO_DP":
        order = [g[0] for g in layout.micro_dp_groups()]
    elif pname == "DP_PROTO":
        order = list(range(w))
    else:  # JOBS_REVERSED
        order = list(reversed(range(w)))
    rows = [(i, r) for r in order for i in seen[r]][:n]  # padding removed from the end
    return {"idx": [i for i, _ in rows], "rank": [r for _, r in rows]}


def check_futures(ctl: Controller, out: dict) -> None:
    actor = ctl.group(Probe, _layout((1, 2, 2)), name="actor", kwargs={"offset": 0.5})
    critic = ctl.group(Probe, _layout((1, 1, 2)), pool=[2, 3], name="critic")
    small = ctl.group(Probe, _layout((1, 1, 2)), pool=[0, 1], name="small")
    x = torch.randn(N_ROWS, WIDE)
    batch = Batch({"x": x, "idx": torch.arange(N_ROWS)})
    ref = x * 2 + 0.5 + 1  # the same arithmetic as a direct loop on the controller
    gen = actor.scale(batch)
    gen.wait()
    before = ctl.stats.snapshot()
    values = critic.add_one(gen)  # 3D_PROTO -> DP_PROTO hand-off, pool [0..3] -> [2, 3]
    values.wait()
    moved = ctl.stats.since(before)
    out["handoff/controller_payload_bytes"] = {"got": moved.payload_out + moved.payload_in,
                                               "expected": 0}
    out["handoff/controller_total_bytes_small"] = {
        "got": moved.total_out + moved.total_in < 16384 < x.numel() * 4, "expected": True}
    out["handoff/consumer_rows"] = {"got": _seen(critic),
                                    "expected": {2: [0, 1, 2, 3], 3: [4, 5, 6, 0]}}
    before = ctl.stats.snapshot()
    got = values.get()
    fetched = ctl.stats.since(before)
    out["handoff/get_counts_payload"] = {"got": fetched.payload_in >= x.numel() * 4,
                                         "expected": True}
    out["handoff/values_exact"] = {"got": torch.equal(got["x"], ref), "expected": True}
    out["handoff/by_rank"] = {"got": got["by"].tolist(), "expected": [2] * 4 + [3] * 3}
    # A chain with padding at every step: 7 rows over 4, 2 then 2 ranks, and a future to a
    # broadcast consumer on another pool.
    first = actor.add_one(Batch({"x": x[:, :8], "idx": torch.arange(N_ROWS)}))
    second = actor.scale(first)
    third = critic.add_one(second)
    chained = third.get()
    out["chain/values_exact"] = {"got": torch.equal(chained["x"], (x[:, :8] + 1) * 2 + 0.5 + 1),
                                 "expected": True}
    out["chain/idx"] = {"got": chained["idx"].tolist(), "expected": list(range(N_ROWS))}
    bcast = small.echo_one_to_all(second).get()
    out["future_to_one_to_all"] = {"got": [b[0]["idx"].tolist() for b in bcast],
                                   "expected": [list(range(N_ROWS))] * 2}
    micro = ctl.group(Probe, _layout((1, 4, 1), (1, 2)), name="micro")
    res = micro.echo_3d_all_micro_dp(values).get()
    out["future_to_micro_dp"] = {"got": [res["idx"].tolist(), _seen(micro)],
                                 "expected": [list(range(N_ROWS)), {0: [0, 1, 2, 3],
                                              1: [0, 1, 2, 3], 2: [4, 5, 6, 0],
                                              3: [4, 5, 6, 0]}]}


def check_inputs_and_errors(ctl: Controller, out: dict) -> None:
    group = ctl.group(Probe, _layout((1, 1, 4)), name="probe")
    out["dp_compute"] = {"got": group.square([1, 2, 3, 4]).get(),
                         "expected": [(r, (r + 1) ** 2) for r in range(4)]}
    errors = {}
    for label, fn in {
        "dp_compute_len": lambda: group.square([1, 2, 3]),
        "undecorated": lambda: group.call(Probe.not_a_worker_method),
        "pool": lambda: ctl.group(Probe, _layout((1, 1, 2)), pool=[1, 7]),
        "pool_size": lambda: ctl.group(Probe, _layout((1, 1, 2)), pool=[0, 1, 2]),
        "sizes": lambda: group.call(Probe.echo_dp_proto, Batch({"idx": torch.arange(3)}),
                                    Batch({"idx": torch.arange(4)})),
        "list_future": lambda: group.echo_dp_proto(
            group.echo_one_to_all(Batch({"idx": torch.arange(3)}))),
    }.items():
        try:
            fn()
            errors[label] = "no error"
        except ValueError as exc:
            errors[label] = str(exc)
    try:
        group.not_a_worker_method
        errors["getattr"] = "no error"
    except AttributeError as exc:
        errors["getattr"] = str(exc)
    out["bad_input_messages"] = {"got": errors, "expected": None}
    try:
        group.fail_on_rank_2().get()
        out["worker_error"] = {"got": "no error", "expected": None}
    except WorkerError as exc:
        out["worker_error"] = {"got": [exc.rank, exc.role, exc.method, exc.remote_traceback],
                               "expected": None}
    slow = ctl.group(Probe, _layout((1, 2, 2)), name="slow", collective_timeout_s=2.0)
    t0 = time.monotonic()
    try:
        slow.unmatched_all_reduce().get()
        out["collective_timeout"] = {"got": "no error", "expected": None}
    except WorkerError as exc:
        out["collective_timeout"] = {"got": [exc.rank, exc.method, exc.error,
                                             time.monotonic() - t0], "expected": None}
    # The job is still usable after bad input and a caught worker error.
    out["still_alive"] = {"got": group.square([5, 6, 7, 8]).get(),
                          "expected": [(r, (r + 5) ** 2) for r in range(4)]}


def _checks(path: str) -> None:
    def program(ctl: Controller) -> None:
        out: dict = {}
        check_protocols(ctl, out)
        check_futures(ctl, out)
        check_inputs_and_errors(ctl, out)
        with open(path, "w") as f:
            json.dump(out, f, default=list)

    sys.exit(run(program, collective_timeout_s=60))


def _raise() -> None:
    def program(ctl: Controller) -> None:
        group = ctl.group(Probe, _layout((1, 1, 4)), name="critic")
        group.fail_on_rank_2().get()

    sys.exit(run(program, collective_timeout_s=60))


def _kill(pid_file: str, target: int) -> None:
    def program(ctl: Controller) -> None:
        group = ctl.group(Probe, _layout((1, 2, 2)), name="actor")
        group.sleep_on_rank(target, pid_file).get()

    sys.exit(run(program, collective_timeout_s=60))


def _stall(pid_file: str, target: int) -> None:
    """Rank ``target`` writes its pid and sleeps in a call (the test SIGSTOPs it); the stall
    timeout comes from HYBRIDFLOW_STALL_TIMEOUT_S."""
    def program(ctl: Controller) -> None:
        group = ctl.group(Probe, _layout((1, 1, ctl.world_size)), name="actor")
        group.sleep_on_rank(target, pid_file).get()

    sys.exit(run(program, collective_timeout_s=60))


# Strangers at the controller's port ----------------------------------------------------------
HANDSHAKE_TIMEOUT_S = 2.0
_STRANGERS: dict = {}  # what rank 1's strangers saw (reported by Probe.knock)
_OPEN: list[socket.socket] = []  # the stalled stranger's socket, kept open on purpose


def code_payloads(marker: str) -> dict[str, bytes]:
    """Pickles that create ``marker`` when plain ``pickle.loads`` runs them, by the callable
    they name (hand-written opcodes, so that the names are exactly these)."""
    def call(module: str, name: str, arg: str) -> bytes:
        return f"c{module}\n{name}\n(V{arg}\ntR.".encode()

    return {"os.system": call("os", "system", f"touch {marker}"),
            "builtins.eval": call("builtins", "eval", f"open({marker!r}, 'w').close()"),
            "subprocess.Popen": (b"csubprocess\nPopen\n((V" + b"touch\nV" + marker.encode()
                                 + b"\nltR.")}


def frame_of(pickled: bytes, kind: int = 0) -> bytes:
    """A control-plane frame around raw pickle bytes (the header of rlhf.controller.wire)."""
    return struct.pack("<QIH", len(pickled), 0, kind) + pickled


def _outcome(sock: socket.socket) -> str:
    """How the controller treated a stranger: ``closed`` (it hung up after at most its
    challenge), ``still open`` (no answer within 20 s) or ``answered ...``."""
    sock.settimeout(20)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    except socket.timeout:
        return "still open"
    finally:
        sock.close()
    if data.startswith(b"HFC1"):
        data = data[36:]  # the challenge that every connection gets first
    return "closed" if not data else f"answered {data[:40]!r}"


def _strangers_at_start_up(host: str, port: int, marker: str) -> None:
    """Rank 1, before it connects: a wrong HMAC claiming to be rank 1, pickles that would run
    code, and a half-sent Hello that then stalls."""
    s = socket.create_connection((host, port), timeout=20)
    s.recv(36)  # the challenge
    s.sendall(handshake.pack_hello(Hello(1, "cmd", bytes(32), bytes(32))))
    _STRANGERS["wrong_hmac"] = _outcome(s)
    for name, pickled in code_payloads(marker).items():
        s = socket.create_connection((host, port), timeout=20)
        try:
            s.sendall(frame_of(pickled))
        except (ConnectionResetError, BrokenPipeError):
            pass
        _STRANGERS[f"payload {name}"] = _outcome(s)
    s = socket.create_connection((host, port), timeout=20)
    s.sendall(handshake.pack_hello(Hello(1, "ctl", bytes(32), bytes(32)))[:10])
    _OPEN.append(s)


def _attack(host: str, port: int, marker: str) -> str:
    try:
        s = socket.create_connection((host, port), timeout=5)
    except ConnectionRefusedError:
        return "refused"
    s.sendall(frame_of(code_payloads(marker)["os.system"]))
    return _outcome(s)


def _intruders(path: str, marker: str) -> None:
    """Strangers connect to the controller's port before the real ranks (rank 1 sends them,
    ranks 2 and 3 connect 1 s later, rank 1 itself after the stalled stranger's handshake timed
    out); during the job, rank 1 knocks again (:meth:`Probe.knock`)."""
    rank = int(os.environ["RANK"])
    if rank != 0:
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        if rank == 1:
            endpoint = rendezvous.lookup(rendezvous.default_store(), {}, rank)
            _STRANGERS.update(host=endpoint.host, port=endpoint.port)
            _strangers_at_start_up(endpoint.host, endpoint.port, marker)
            time.sleep(HANDSHAKE_TIMEOUT_S + 2)
            _STRANGERS["stalled"] = _outcome(_OPEN.pop())
        else:
            time.sleep(1)

    def program(ctl: Controller) -> None:
        group = ctl.group(Probe, _layout((1, 1, 4)), name="probe")
        report = next(r for r in group.knock(marker).get() if r is not None)
        out = {"report": report, "square": group.square([1, 2, 3, 4]).get()}
        with open(path, "w") as f:
            json.dump(out, f)

    sys.exit(run(program, collective_timeout_s=60, handshake_timeout_s=HANDSHAKE_TIMEOUT_S))


if __name__ == "__main__":
    mode = sys.argv[1]
    {"checks": lambda: _checks(sys.argv[2]), "raise": _raise,
     "kill": lambda: _kill(sys.argv[2], int(sys.argv[3])),
     "stall": lambda: _stall(sys.argv[2], int(sys.argv[3])),
     "intruders": lambda: _intruders(sys.argv[2], sys.argv[3])}[mode]()
