"""Who may talk to the controller: a challenge-response handshake on every connection.

Every connection to the controller's port starts with three fixed-size frames, parsed with
``struct`` (never pickle: the peer has not proved anything yet)::

    controller (rank 0)                                              rank r
      accept, Challenge   "HFC1" | nonce_c (32)                ---->
                   <----  Hello   "HFH1" | rank u32 | channel u8 | nonce_r (32) | mac_r (32)
      check mac_r, Welcome "HFW1" | mac_w (32)                 ---->  check mac_w

    mac_r = HMAC-SHA256(secret, "hybridflow hello"   | nonce_c | rank | channel | nonce_r)
    mac_w = HMAC-SHA256(secret, "hybridflow welcome" | nonce_r | nonce_c | rank | channel)

``secret`` is the job's (:mod:`rlhf.controller.rendezvous`).  ``nonce_c`` is fresh for every
connection, so a Hello recorded on one connection does not fit another (no replay); ``mac_w``
shows the rank that it talks to the real controller; the two labels keep one MAC from being
reflected as the other.  MACs are compared with :func:`hmac.compare_digest`.

The controller runs every pending handshake at once on non-blocking sockets, each with its own
deadline: a peer that sends bytes that are not a Hello is closed at once, one that stalls is
closed after ``handshake_timeout_s``, and neither delays the real ranks.  Every refusal is
logged to stderr with the peer's address and the reason.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import selectors
import socket
import struct
import sys
import time
from dataclasses import dataclass

from rlhf.controller.errors import ControllerError
from rlhf.controller.messages import Challenge, Hello, Welcome

CHANNELS = ("cmd", "ctl")
"""Connections of every rank other than 0, in the order the rank opens them."""
NONCE_BYTES = 32
MAX_PENDING = 64
"""Handshakes in flight at once; a connection beyond that is closed at once."""

_CHALLENGE = struct.Struct("<4s32s")
_HELLO = struct.Struct("<4sIB32s32s")
_WELCOME = struct.Struct("<4s32s")
_MAGIC_CHALLENGE, _MAGIC_HELLO, _MAGIC_WELCOME = b"HFC1", b"HFH1", b"HFW1"


class HandshakeError(ControllerError):
    """A rank could not prove itself to the controller, or the controller to the rank."""


# Frames and MACs -----------------------------------------------------------------------------
def pack_challenge(msg: Challenge) -> bytes:
    return _CHALLENGE.pack(_MAGIC_CHALLENGE, msg.nonce)


def unpack_challenge(raw: bytes) -> Challenge:
    magic, nonce = _CHALLENGE.unpack(raw)
    if magic != _MAGIC_CHALLENGE:
        raise HandshakeError(f"the peer is not a hybridflow controller (it sent {raw[:8]!r})")
    return Challenge(nonce)


def pack_hello(msg: Hello) -> bytes:
    return _HELLO.pack(_MAGIC_HELLO, msg.rank, CHANNELS.index(msg.channel), msg.nonce, msg.mac)


def unpack_hello(raw: bytes | bytearray) -> Hello:
    magic, rank, channel, nonce, mac = _HELLO.unpack(raw)
    if magic != _MAGIC_HELLO or channel >= len(CHANNELS):
        raise ValueError(f"not a hybridflow Hello (it starts {bytes(raw[:16])!r})")
    return Hello(rank, CHANNELS[channel], nonce, mac)


def pack_welcome(msg: Welcome) -> bytes:
    return _WELCOME.pack(_MAGIC_WELCOME, msg.mac)


def unpack_welcome(raw: bytes) -> Welcome:
    magic, mac = _WELCOME.unpack(raw)
    if magic != _MAGIC_WELCOME:
        raise HandshakeError(f"the peer is not a hybridflow controller (it sent {raw[:8]!r})")
    return Welcome(mac)


def _who(rank: int, channel: str) -> bytes:
    return struct.pack("<IB", rank, CHANNELS.index(channel))


def hello_mac(secret: bytes, challenge: bytes, rank: int, channel: str, nonce: bytes) -> bytes:
    """The rank's proof: covers the controller's challenge, who it is and its own nonce."""
    return hmac.new(secret, b"hybridflow hello" + challenge + _who(rank, channel) + nonce,
                    hashlib.sha256).digest()


def welcome_mac(secret: bytes, challenge: bytes, hello: Hello) -> bytes:
    """The controller's proof: covers the rank's nonce, so it fits this connection only."""
    return hmac.new(secret, b"hybridflow welcome" + hello.nonce + challenge
                    + _who(hello.rank, hello.channel), hashlib.sha256).digest()


# Rank side ------------------------------------------------------------------------------------
_CLOSED_BEFORE = {
    "challenge": "its challenge (the start-up is over, or too many connections are pending)",
    "welcome": "its welcome: it refused this rank's proof (is HYBRIDFLOW_SECRET the same on "
               "every rank?)",
}


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HandshakeError(f"the controller closed the connection before "
                                 f"{_CLOSED_BEFORE[what]}")
        buf += chunk
    return bytes(buf)


def connect(host: str, port: int, rank: int, channel: str, secret: bytes,
            timeout_s: float) -> socket.socket:
    """Open one of rank ``rank``'s connections to the controller and run the handshake.

    Args:
        timeout_s: limit on connecting and on each read of the handshake.

    Returns:
        A blocking socket, ready for :mod:`rlhf.controller.wire` messages.

    Raises:
        HandshakeError: the controller refused the rank, or failed to prove the secret.
    """
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise HandshakeError(f"rank {rank} cannot reach the controller at {host}:{port}: "
                             f"{exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        challenge = unpack_challenge(_recv_exact(sock, _CHALLENGE.size, "challenge"))
        nonce = secrets.token_bytes(NONCE_BYTES)
        hello = Hello(rank, channel, nonce, hello_mac(secret, challenge.nonce, rank, channel,
                                                      nonce))
        sock.sendall(pack_hello(hello))
        welcome = unpack_welcome(_recv_exact(sock, _WELCOME.size, "welcome"))
        if not hmac.compare_digest(welcome.mac, welcome_mac(secret, challenge.nonce, hello)):
            raise HandshakeError(f"the peer at {host}:{port} does not know the job's secret: "
                                 f"it is not this job's controller")
        sock.settimeout(None)
        return sock
    except socket.timeout:
        sock.close()
        raise HandshakeError(f"rank {rank}: no handshake from the controller at {host}:{port} "
                             f"within {timeout_s} s") from None
    except OSError as exc:
        sock.close()
        raise HandshakeError(f"rank {rank}: the connection to the controller at {host}:{port} "
                             f"failed during the handshake: {exc}") from None
    except BaseException:
        sock.close()
        raise


# Controller side ------------------------------------------------------------------------------
def _log(message: str) -> None:
    print(f"[hybridflow] controller: {message}", file=sys.stderr, flush=True)


@dataclass
class _Pending:
    """A connection whose Hello has not arrived in full yet."""

    peer: str
    challenge: bytes
    deadline: float
    received: bytearray


class _Acceptor:
    """The controller's side of every handshake of the start-up (see the module docstring)."""

    def __init__(self, server: socket.socket, world_size: int, secret: bytes,
                 handshake_timeout_s: float) -> None:
        self.server = server
        self.secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.expected = {(r, c) for r in range(1, world_size) for c in CHANNELS}
        self.done: dict[tuple[int, str], socket.socket] = {}
        self.pending: dict[socket.socket, _Pending] = {}
        self.selector = selectors.DefaultSelector()
        server.setblocking(False)
        self.selector.register(server, selectors.EVENT_READ)

    def run(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.done) < len(self.expected):
            now = time.monotonic()
            for sock, p in list(self.pending.items()):
                if now >= p.deadline:
                    self.refuse(sock, f"no complete Hello within {self.handshake_timeout_s} s")
            if now >= deadline:
                missing = sorted({r for r, c in self.expected - self.done.keys()})
                raise ControllerError(f"ranks {missing} did not connect to the controller "
                                      f"within {timeout_s} s")
            wake = min([deadline, *(p.deadline for p in self.pending.values())])
            for key, _ in self.selector.select(max(0.0, wake - now)):
                if key.fileobj is self.server:
                    self.accept()
                else:
                    self.read(key.fileobj)

    def accept(self) -> None:
        try:
            sock, addr = self.server.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            _log(f"accept failed: {exc}")
            return
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        if len(self.pending) >= MAX_PENDING:
            _log(f"refused a connection from {peer}: {MAX_PENDING} handshakes in flight")
            sock.close()
            return
        sock.setblocking(False)
        nonce = secrets.token_bytes(NONCE_BYTES)
        self.pending[sock] = _Pending(peer, nonce, time.monotonic() + self.handshake_timeout_s,
                                      bytearray())
        self.selector.register(sock, selectors.EVENT_READ)
        try:  # 36 bytes into a fresh socket's empty send buffer: never partial
            sent = sock.send(pack_challenge(Challenge(nonce)))
        except OSError as exc:
            self.refuse(sock, f"cannot send the challenge: {exc}")
            return
        if sent != _CHALLENGE.size:
            self.refuse(sock, "cannot send the challenge")

    def read(self, sock: socket.socket) -> None:
        p = self.pending[sock]
        try:
            chunk = sock.recv(_HELLO.size - len(p.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.refuse(sock, f"connection error during the handshake: {exc}")
            return
        if not chunk:
            self.refuse(sock, "it closed the connection during the handshake")
            return
        p.received += chunk
        head = bytes(p.received[:len(_MAGIC_HELLO)])
        if head != _MAGIC_HELLO[:len(head)]:
            self.refuse(sock, f"not a hybridflow handshake (it sent {bytes(p.received[:16])!r})")
            return
        if len(p.received) < _HELLO.size:
            return
        try:
            hello = unpack_hello(p.received)
        except ValueError as exc:
            self.refuse(sock, str(exc))
            return
        proof = hello_mac(self.secret, p.challenge, hello.rank, hello.channel, hello.nonce)
        if not hmac.compare_digest(hello.mac, proof):
            self.refuse(sock, f"wrong HMAC for rank {hello.rank} (not a rank of this job, or "
                              f"another HYBRIDFLOW_SECRET)")
        elif (hello.rank, hello.channel) not in self.expected:
            self.refuse(sock, f"rank {hello.rank} is not a rank 1..{len(self.expected) // 2} "
                              f"of this job")
        elif (hello.rank, hello.channel) in self.done:
            self.refuse(sock, f"rank {hello.rank} already connected its {hello.channel} channel")
        else:
            self.welcome(sock, p, hello)

    def welcome(self, sock: socket.socket, p: _Pending, hello: Hello) -> None:
        try:
            sent = sock.send(pack_welcome(Welcome(welcome_mac(self.secret, p.challenge, hello))))
        except OSError as exc:
            self.refuse(sock, f"cannot send the welcome: {exc}")
            return
        if sent != _WELCOME.size:
            self.refuse(sock, "cannot send the welcome")
            return
        self.selector.unregister(sock)
        del self.pending[sock]
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.done[(hello.rank, hello.channel)] = sock

    def refuse(self, sock: socket.socket, reason: str) -> None:
        p = self.pending.pop(sock)
        _log(f"refused a connection from {p.peer}: {reason}")
        self.selector.unregister(sock)
        sock.close()

    def close(self, failed: bool) -> None:
        for sock in list(self.pending):
            self.refuse(sock, "the start-up is over before its handshake finished")
        if failed:
            for sock in self.done.values():
                sock.close()
        self.selector.close()


def accept_ranks(server: socket.socket, world_size: int, secret: bytes, timeout_s: float,
                 handshake_timeout_s: float
                 ) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    """Accept both connections of every rank 1..world_size-1 that proves the job's secret.

    Connections that fail the handshake are closed and logged; the start-up goes on waiting
    for the real ranks.

    Args:
        server: the listening socket (left open: the caller closes it).
        timeout_s: limit on the whole start-up.
        handshake_timeout_s: limit on one connection's handshake.

    Returns:
        (rank -> command socket, rank -> abort socket), blocking sockets.

    Raises:
        ControllerError: some ranks did not connect within ``timeout_s``.
    """
    acceptor = _Acceptor(server, world_size, secret, handshake_timeout_s)
    failed = True
    try:
        acceptor.run(timeout_s)
        failed = False
    finally:
        acceptor.close(failed)
    return ({r: s for (r, c), s in acceptor.done.items() if c == "cmd"},
            {r: s for (r, c), s in acceptor.done.items() if c == "ctl"})
