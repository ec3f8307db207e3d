"""The control plane's defences: allow-list decoding (nothing the sender names runs), frame size
limits, the HMAC handshake (strangers, replays, stalls), the bind address and the secret, and
one torchrun job whose port strangers attack during the start-up and during the job."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
import typing

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.controller import Batch, Controller, ControllerError, Worker, WorkerError, wire
from rlhf.controller import handshake, rendezvous
from rlhf.controller.messages import MESSAGES, Abort, Call, Challenge, Hello, astuple
from rlhf.controller.protocols import ONE_TO_ALL, protocol
from rlhf.controller.worker import WorkerRuntime
from tests.controller_jobs import HANDSHAKE_TIMEOUT_S, code_payloads, frame_of
from tests.values import same

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = b"s" * 32


class _Reduce:
    """Pickles (with the standard pickler) as the call ``fn(*args)``."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class Unregistered:
    """A module-level class that nobody allowed."""


@wire.allow
@dataclasses.dataclass(frozen=True)
class Registered:
    """A module-level dataclass allowed by the decorator."""

    name: str
    values: tuple


class BatchSubclass(Batch):
    pass


# Decoding runs nothing the sender names -------------------------------------------------------
@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "subprocess.Popen"])
def test_payloads_are_live_with_plain_pickle(tmp_path, name):
    """The payloads are real: plain pickle.loads runs them (so the refusals below mean it)."""
    marker = tmp_path / "ran"
    out = pickle.loads(code_payloads(str(marker))[name])
    if isinstance(out, subprocess.Popen):
        out.wait(timeout=30)
    assert marker.exists()


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "subprocess.Popen"])
def test_loads_refuses_code_naming_pickles_and_runs_nothing(tmp_path, name):
    marker = tmp_path / "ran"
    payload = code_payloads(str(marker))[name]
    nested = pickle.dumps(astuple(Call(1, 1, "m", (Batch(), _Reduce(os.system, f"touch {marker}")),
                                       {}, False, False, (), ())), protocol=5)
    blobs = {"top level": frame_of(payload), "as a message": frame_of(payload, kind=1),
             "inside a Call": frame_of(nested, kind=MESSAGES.index(Call) + 1)}
    for where, blob in blobs.items():
        with pytest.raises(wire.UnsafeMessageError, match=r"refused to decode (os|posix)\."
                           if where == "inside a Call" else rf"refused to decode {name}"):
            wire.loads(blob)
        assert not marker.exists(), where


def test_recv_msg_refuses_code_naming_pickles(tmp_path):
    marker = tmp_path / "ran"
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame_of(code_payloads(str(marker))["os.system"]))
        with pytest.raises(wire.UnsafeMessageError, match="os.system"):
            wire.recv_msg(b)
    assert not marker.exists()


def test_torch_pickle_path_is_refused():
    """A tensor pickled by torch itself names torch's rebuild functions: not on the list."""
    with pytest.raises(wire.UnsafeMessageError, match=r"torch\._utils\._rebuild_tensor"):
        wire.loads(frame_of(pickle.dumps(torch.ones(3), protocol=5)))


@pytest.mark.parametrize("args, error", [
    ((bytearray(), "float32", (1 << 40,)), "needs 4398046511104 bytes"),  # no 4 TiB allocation
    ((bytearray(8), "float32", (-2,)), "not a tuple of sizes"),
    ((bytearray(8), "load", (2,)), "dtype 'load'"),
    (("not a buffer", "float32", (0,)), "not a buffer"),
])
def test_tensor_rebuild_checks_dtype_shape_and_bytes(args, error):
    blob = frame_of(pickle.dumps(_Reduce(wire._rebuild_tensor, *args), protocol=5))
    with pytest.raises(wire.MessageError, match=error):
        wire.loads(blob)


def test_numpy_rebuild_refuses_object_dtypes():
    blob = frame_of(pickle.dumps(_Reduce(wire._rebuild_numpy, b"", "|O8", None), protocol=5))
    with pytest.raises(wire.UnsafeMessageError, match="bool and numeric"):
        wire.loads(blob)


def test_malformed_frames_are_refused():
    good = wire.dumps(Abort("x"))
    with pytest.raises(wire.MessageError, match="truncated|adds up"):
        wire.loads(good[:-1])
    with pytest.raises(wire.MessageError, match="malformed"):
        wire.loads(frame_of(b"\x80\x05garbage"))
    with pytest.raises(wire.MessageError, match="Abort"):
        wire.loads(frame_of(pickle.dumps((1, 2, 3)), kind=MESSAGES.index(Abort) + 1))


# What the runtime sends still travels ---------------------------------------------------------


def test_plain_values_tensors_and_numpy_roundtrip():
    value = {
        "containers": [(1, 2.5, "s", b"b", None, True), {3, 4}, frozenset({5}), bytearray(b"x"),
                       1 << 100, complex(1, 2)],
        "tensors": [torch.randn(3, 4).t(), torch.arange(6).reshape(2, 3)[:, 1],
                    torch.randn(2).to(torch.bfloat16), torch.tensor(True), torch.zeros(0, 3),
                    torch.randn(2, dtype=torch.complex64), torch.tensor(7, dtype=torch.uint8)],
        "torch": [torch.float32, torch.bfloat16, torch.int64, torch.Size([2, 3]),
                  torch.device("cpu")],
        "numpy": [np.float32(1.5), np.int64(-3), np.bool_(True), np.arange(6.0).reshape(2, 3),
                  np.array(4, dtype=np.int16)],
        "stdlib": [datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.timezone.utc),
                   datetime.date(2026, 1, 2), datetime.timedelta(seconds=3),
                   decimal.Decimal("1.25")],
        "registered": Registered("r", (1, torch.ones(2))),
        "batch": Batch({"x": torch.ones(2, 2)}, {"uid": ["a", "b"]}, {"t": 0.5}),
    }
    assert same(wire.loads(wire.dumps(value)), value)


def _runtime_objects() -> list:
    """Worker specs, configs and sampling parameters as the builders make them for a run."""
    from rlhf import builders
    from rlhf.config import load_config, resolve_devices
    from rlhf.world_plan import validate_for_world
    from rlhf.task import CostRule
    from rlhf.workers import OverlongShaping, ScoreSpec

    cfg, _ = resolve_devices(load_config(["algo=safe_rlhf", "actor.model.hidden_size=32",
                                          "actor.model.intermediate_size=64"]))
    plan = validate_for_world(cfg, 2)
    tok = builders.tokenizer_of(cfg)
    return [builders.actor_spec(cfg, plan), builders.critic_spec(cfg, plan, "critic", 1),
            builders.reference_spec(cfg), builders.sampling_of(cfg, 3, tok),
            ScoreSpec(model=None, precision=builders.run_precision(cfg), model_weight=0.0,
                      rule_weights={"exact": 1.0},
                      cost_rule=CostRule("7", 4), function=None, tokenizer=None,
                      overlong=OverlongShaping(max_len=6, buffer=2, factor=0.5))]


def test_runtime_specs_and_configs_roundtrip():
    objects = _runtime_objects()
    assert same(wire.loads(wire.dumps(objects)), objects)


def _dataclasses_in(tp, seen: set) -> None:
    for arg in typing.get_args(tp):
        _dataclasses_in(arg, seen)
    if dataclasses.is_dataclass(tp) and tp not in seen:
        seen.add(tp)
        for t in typing.get_type_hints(tp).values():
            _dataclasses_in(t, seen)


def test_every_dataclass_inside_the_worker_specs_is_allowed():
    """A config dataclass added to a spec without being allowed would fail the job's first
    Create: this names it first."""
    from rlhf.workers import specs

    seen: set = set()
    for cls in (specs.ActorSpec, specs.CriticSpec, specs.ReferenceSpec, specs.ScoreSpec):
        _dataclasses_in(cls, seen)
    for cls in seen:
        assert wire._lookup(cls.__module__, cls.__qualname__) is cls


def test_project_classes_name_module_level_frozen_dataclasses():
    for path in wire.PROJECT_CLASSES:
        module, name = path.split(":")
        cls = wire._lookup(module, name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, path


# The encoder refuses what the decoder would ---------------------------------------------------
@pytest.mark.parametrize("value, name", [
    (Unregistered(), "an instance of tests.test_control_plane_security.Unregistered"),
    ([1, {"k": Unregistered}], "the class tests.test_control_plane_security.Unregistered"),
    (os.system, "the function (os|posix).system"),
    (BatchSubclass(), "an instance of tests.test_control_plane_security.BatchSubclass"),
    (torch.ones(2, 2).to_sparse(), "sparse_coo tensor"),
    (np.array(["a"], dtype=object), "dtype object"),
])
def test_encoder_refuses_values_outside_the_allow_list(value, name):
    with pytest.raises(wire.UnsafeMessageError, match=name):
        wire.dumps(value)


def test_allow_refuses_local_classes():
    class Local:
        pass

    with pytest.raises(TypeError, match="module level"):
        wire.allow(Local)


# Size limits ----------------------------------------------------------------------------------
@pytest.mark.parametrize("head, lens", [
    (struct.pack("<QIH", 1 << 40, 0, 0), b""),  # a 1 TiB pickle: refused before allocating
    (struct.pack("<QIH", 10, (1 << 32) - 1, 0), b""),  # 32 GiB of buffer lengths
    (struct.pack("<QIH", 10, 1, 0), struct.pack("<Q", 1 << 50)),  # one huge buffer
])
def test_recv_refuses_frames_over_the_limit_before_allocating(head, lens):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(head + lens)
        with pytest.raises(wire.MessageTooLargeError, match="max_message_bytes=1048576"):
            wire.recv_msg(b, max_bytes=1 << 20)


def test_send_refuses_frames_over_the_limit_and_writes_nothing():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(wire.MessageTooLargeError, match="max_message_bytes=65536"):
            wire.send_msg(a, Batch({"x": torch.zeros(1 << 15)}), max_bytes=1 << 16)
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)


class Replies(Worker):
    @protocol(ONE_TO_ALL)
    def unregistered(self) -> Unregistered:
        return Unregistered()

    @protocol(ONE_TO_ALL)
    def big(self) -> torch.Tensor:
        return torch.zeros(1 << 15)

    @protocol(ONE_TO_ALL)
    def echo(self, value):
        return value

    @protocol(ONE_TO_ALL)
    def data_less(self) -> torch.Tensor:
        return torch.zeros(4, device="meta")  # its copy to the host raises while encoding


@pytest.fixture
def one_rank_group():
    """A controller and rank 0's worker over a socket pair, 64 KiB frame limit on both sides."""
    a, b = socket.socketpair()
    runtime = WorkerRuntime(0, b, None, 60.0, max_message_bytes=1 << 16)
    thread = threading.Thread(target=runtime.serve, daemon=True)
    thread.start()
    ctl = Controller({0: a}, {}, max_message_bytes=1 << 16)
    yield ctl.group(Replies, HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    ctl.shutdown()
    thread.join(timeout=10)


def test_replies_and_commands_that_cannot_travel_fail_the_call_not_the_rank(one_rank_group):
    with pytest.raises(WorkerError, match="UnsafeMessageError: cannot send an instance of "
                                          "tests.test_control_plane_security.Unregistered"):
        one_rank_group.unregistered().get()
    with pytest.raises(WorkerError, match="MessageTooLargeError"):
        one_rank_group.big().get()
    with pytest.raises(WorkerError, match="NotImplementedError: Cannot copy out of meta"):
        one_rank_group.data_less().get()
    with pytest.raises(wire.UnsafeMessageError, match="Unregistered"):
        one_rank_group.echo(Unregistered())  # refused before any rank got it
    with pytest.raises(wire.MessageTooLargeError):
        one_rank_group.echo(torch.zeros(1 << 15))
    assert one_rank_group.echo(Registered("ok", ())).get() == [Registered("ok", ())]


# Handshake ------------------------------------------------------------------------------------
class _Startup:
    """rank 0's accept loop in a thread, on a loopback port."""

    def __init__(self, world_size: int, timeout_s: float = 30.0,
                 handshake_timeout_s: float = 5.0) -> None:
        self.server = rendezvous.open_server(rendezvous.LOOPBACK, world_size)
        self.port = self.server.getsockname()[1]
        self.result: tuple | BaseException | None = None
        self.elapsed = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       args=(world_size, timeout_s, handshake_timeout_s))
        self.thread.start()

    def _run(self, world_size, timeout_s, handshake_timeout_s) -> None:
        t0 = time.monotonic()
        try:
            self.result = handshake.accept_ranks(self.server, world_size, SECRET, timeout_s,
                                                 handshake_timeout_s)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.result = exc
        self.elapsed = time.monotonic() - t0
        self.server.close()

    def rank(self, rank: int, channel: str, secret: bytes = SECRET) -> socket.socket:
        return handshake.connect("127.0.0.1", self.port, rank, channel, secret, 10.0)

    def all_ranks(self, world_size: int) -> list[socket.socket]:
        return [self.rank(r, c) for r in range(1, world_size) for c in handshake.CHANNELS]

    def join(self) -> tuple:
        self.thread.join(timeout=60)
        assert isinstance(self.result, tuple), self.result
        return self.result


def _closed(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    """The peer hung up, having sent at most its challenge."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    finally:
        sock.close()
    return (data[36:] if data.startswith(b"HFC1") else data) == b""


def _hello(sock: socket.socket, rank: int, channel: str, secret: bytes) -> bytes:
    """A rank's Hello for the challenge that ``sock`` received."""
    challenge = handshake.unpack_challenge(sock.recv(36))
    nonce = os.urandom(32)
    mac = handshake.hello_mac(secret, challenge.nonce, rank, channel, nonce)
    return handshake.pack_hello(Hello(rank, channel, nonce, mac))


def test_stranger_with_wrong_secret_is_refused_and_start_up_goes_on(capfd):
    start = _Startup(3)
    stranger = socket.create_connection(("127.0.0.1", start.port))
    stranger.sendall(_hello(stranger, 1, "cmd", b"not the secret" * 3))
    assert _closed(stranger)
    socks = start.all_ranks(3)
    cmd, ctl = start.join()
    assert sorted(cmd) == sorted(ctl) == [1, 2]
    assert "wrong HMAC for rank 1" in capfd.readouterr().err
    for s in socks:  # the admitted sockets carry wire messages
        s.close()
    for s in [*cmd.values(), *ctl.values()]:
        s.close()


def test_recorded_hello_cannot_be_replayed(capfd):
    start = _Startup(2)
    first = socket.create_connection(("127.0.0.1", start.port))
    recorded = _hello(first, 1, "cmd", SECRET)
    first.sendall(recorded)
    assert first.recv(4)[:4] == b"HFW1"  # admitted
    replay = socket.create_connection(("127.0.0.1", start.port))
    replay.recv(36)
    replay.sendall(recorded)
    assert _closed(replay)
    start.rank(1, "ctl")
    cmd, ctl = start.join()
    assert list(cmd) == list(ctl) == [1]
    assert "wrong HMAC" in capfd.readouterr().err


def test_duplicate_and_out_of_range_ranks_are_refused(capfd):
    start = _Startup(2)
    start.rank(1, "cmd")
    for rank in (1, 5):
        s = socket.create_connection(("127.0.0.1", start.port))
        s.sendall(_hello(s, rank, "cmd", SECRET))
        assert _closed(s)
    start.rank(1, "ctl")
    start.join()
    err = capfd.readouterr().err
    assert "rank 1 already connected its cmd channel" in err
    assert "rank 5 is not a rank 1..1 of this job" in err


def test_garbage_and_stalled_peers_do_not_delay_the_real_ranks(tmp_path, capfd):
    marker = tmp_path / "ran"
    start = _Startup(4, handshake_timeout_s=HANDSHAKE_TIMEOUT_S + 3)
    stalled = socket.create_connection(("127.0.0.1", start.port))
    stalled.sendall(b"HFH1\x01\x00")  # half a header, then nothing
    for payload in code_payloads(str(marker)).values():
        s = socket.create_connection(("127.0.0.1", start.port))
        s.sendall(frame_of(payload))
        assert _closed(s)
    t0 = time.monotonic()
    start.all_ranks(4)
    start.join()
    assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 3  # not held up by the stalled peer
    assert _closed(stalled)  # closed when the start-up ended
    assert not marker.exists()
    err = capfd.readouterr().err
    assert err.count("not a hybridflow handshake") == 3
    assert "the start-up is over before its handshake finished" in err


def test_stalled_peer_is_closed_after_the_handshake_timeout(capfd):
    start = _Startup(2, handshake_timeout_s=0.5)
    stalled = socket.create_connection(("127.0.0.1", start.port))
    stalled.sendall(b"HFH1")
    t0 = time.monotonic()
    assert _closed(stalled)
    assert 0.4 < time.monotonic() - t0 < 5
    start.rank(1, "cmd"), start.rank(1, "ctl")
    start.join()
    assert "no complete Hello within 0.5 s" in capfd.readouterr().err


def test_start_up_times_out_naming_the_missing_ranks():
    start = _Startup(3, timeout_s=1.0)
    start.rank(1, "cmd"), start.rank(1, "ctl"), start.rank(2, "cmd")
    start.thread.join(timeout=30)
    assert isinstance(start.result, ControllerError) and "ranks [2]" in str(start.result)


def test_rank_refuses_a_controller_without_the_secret():
    server = rendezvous.open_server(rendezvous.LOOPBACK, 2)
    port = server.getsockname()[1]

    def fake_controller(welcome: bool) -> None:
        conn, _ = server.accept()
        conn.sendall(handshake.pack_challenge(Challenge(bytes(32))))
        conn.recv(73)
        if welcome:
            conn.sendall(b"HFW1" + bytes(32))
        conn.close()

    for welcome, error in [(True, "does not know the job's secret"),
                           (False, "is HYBRIDFLOW_SECRET the same on every rank")]:
        t = threading.Thread(target=fake_controller, args=(welcome,))
        t.start()
        with pytest.raises(handshake.HandshakeError, match=error):
            handshake.connect("127.0.0.1", port, 1, "cmd", SECRET, 10.0)
        t.join()
    server.close()


# Bind address and secret ----------------------------------------------------------------------
def test_listen_host_is_loopback_or_master_addr_never_the_wildcard():
    single = {"MASTER_ADDR": socket.gethostname(), "LOCAL_WORLD_SIZE": "4"}
    assert rendezvous.listen_host(single, 4) == "127.0.0.1"
    assert rendezvous.listen_host({}, 8) == "127.0.0.1"
    multi = {"MASTER_ADDR": "127.0.0.2", "LOCAL_WORLD_SIZE": "4"}
    assert rendezvous.listen_host(multi, 8) == "127.0.0.2"
    server = rendezvous.open_server(rendezvous.listen_host(multi, 8), 8)
    assert server.getsockname()[0] == "127.0.0.2"
    server.close()
    with pytest.raises(ValueError, match="wildcard"):
        rendezvous.listen_host({"MASTER_ADDR": "0.0.0.0"}, 8)
    with pytest.raises(ValueError, match="does not resolve"):
        rendezvous.listen_host({"MASTER_ADDR": "no-such-host.invalid"}, 8)
    with pytest.raises(ValueError, match="MASTER_ADDR must name the host that runs rank 0"):
        rendezvous.open_server("192.0.2.1", 8)  # TEST-NET-1: not an address of this host


def test_secret_through_the_store_or_from_the_operator():
    store = dist.HashStore()
    server, endpoint = rendezvous.open_controller(store, {}, 4)
    server.close()
    assert len(endpoint.secret) == 32 and endpoint.secret.hex() not in repr(endpoint)
    assert rendezvous.lookup(store, {}, 1) == endpoint
    with pytest.raises(ControllerError, match="set on rank 2 but not on rank 0"):
        rendezvous.lookup(store, {"HYBRIDFLOW_SECRET": "x" * 16}, 2)
    rendezvous.retract(store)
    assert not store.check([rendezvous.KEY])

    env = {"HYBRIDFLOW_SECRET": "operator secret 0123"}
    server, endpoint = rendezvous.open_controller(store, env, 4)
    server.close()
    assert json.loads(store.get(rendezvous.KEY))["secret"] is None  # never in the store
    assert rendezvous.lookup(store, env, 1).secret == b"operator secret 0123"
    with pytest.raises(ControllerError, match="rank 3 has none"):
        rendezvous.lookup(store, {}, 3)
    rendezvous.retract(store)

    with pytest.raises(ValueError, match="at least 16"):
        rendezvous.open_controller(store, {"HYBRIDFLOW_SECRET": "short"}, 4)
    with pytest.raises(ControllerError, match="rank 0 could not start the controller: "
                                              "HYBRIDFLOW_SECRET has 5 bytes"):
        rendezvous.lookup(store, {}, 1)


# Strangers at a real job's port ---------------------------------------------------------------
def test_strangers_at_the_port_during_start_up_and_job(tmp_path):
    """Rank 1 sends strangers first (a wrong HMAC, three pickles that would run code, a stalled
    half Hello), then knocks again during the job: the job starts, runs and ends with 0, nothing
    runs, every stranger is closed and logged."""
    out, marker = tmp_path / "out.json", tmp_path / "ran"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", "-m", "tests.controller_jobs", "intruders", str(out), str(marker)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not marker.exists()
    result = json.loads(out.read_text())
    assert result["square"] == [[r, (r + 1) ** 2] for r in range(4)]
    report = result["report"]
    assert report["host"] == "127.0.0.1"  # single node: loopback, not every interface
    for name in ("wrong_hmac", "payload os.system", "payload builtins.eval",
                 "payload subprocess.Popen", "stalled"):
        assert report[name] == "closed", (name, report)
    assert report["during_job"] == "refused"  # the port closed once every rank was in
    assert "wrong HMAC for rank 1" in proc.stderr
    assert proc.stderr.count("not a hybridflow handshake") == 3
    assert f"no complete Hello within {HANDSHAKE_TIMEOUT_S} s" in proc.stderr


def test_job_with_the_operators_secret():
    """HYBRIDFLOW_SECRET on every rank: the job starts (and surfaces a worker error as usual);
    the secret appears nowhere in its output."""
    secret = "operator-secret-" + os.urandom(8).hex()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", "-m", "tests.controller_jobs", "raise"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HYBRIDFLOW_SECRET=secret))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "worker rank 2 (role 'critic') failed in critic.fail_on_rank_2" in out, out[-3000:]
    assert secret not in out
