"""Where the controller listens and the job's secret, handed to the ranks through the store.

Rank 0 binds the controller's socket to one interface, never the wildcard address:

* loopback (127.0.0.1) when every rank runs on its node (torchrun's ``LOCAL_WORLD_SIZE`` equals
  the world size) or no ``MASTER_ADDR`` is set;
* otherwise the address that ``MASTER_ADDR`` resolves to, the one the ranks already reach rank
  0's node on (torchrun puts the job's store there).

The job's secret is ``HYBRIDFLOW_SECRET`` when the operator sets it (on every node; it then
never enters the store), else 32 random bytes from rank 0.  Rank 0 publishes one JSON record
under :data:`KEY` in the store that ``init_process_group`` set up (torchrun's TCPStore)::

    {"host": "127.0.0.1", "port": 40123, "secret": "<64 hex digits>" | null}
    {"error": "<why rank 0 could not listen>"}      (the other ranks fail at once, naming it)

and deletes it once every rank has connected, so the secret lives in the store only during the
start-up.  The store itself is not authenticated: see docs/trust_model.md.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.distributed as dist

from rlhf.controller.errors import ControllerError

KEY = "hybridflow/controller"
SECRET_ENV = "HYBRIDFLOW_SECRET"
MIN_SECRET_BYTES = 16
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Endpoint:
    """Where the controller listens and the secret that its handshake checks."""

    host: str
    """IP address of the controller's socket (never the wildcard)."""
    port: int
    """Its port."""
    secret: bytes = field(repr=False)
    """The job's secret (kept out of reprs and logs)."""


def listen_host(env: Mapping[str, str], world_size: int) -> str:
    """The IP address the controller binds (see the module docstring).

    Raises:
        ValueError: ``MASTER_ADDR`` does not resolve, or resolves to the wildcard address.
    """
    master = env.get("MASTER_ADDR")
    local = env.get("LOCAL_WORLD_SIZE")
    if not master or world_size == 1 or (local is not None and int(local) >= world_size):
        return LOOPBACK
    try:
        infos = socket.getaddrinfo(master, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"MASTER_ADDR={master!r} does not resolve ({exc}): the controller "
                         f"listens on rank 0's address for the other nodes") from None
    ip = str(infos[0][4][0])
    if ipaddress.ip_address(ip.split("%")[0]).is_unspecified:
        raise ValueError(f"MASTER_ADDR={master!r} is the wildcard address {ip}: the controller "
                         f"listens on one interface only; set MASTER_ADDR to rank 0's address")
    return ip


def open_server(host: str, world_size: int) -> socket.socket:
    """A listening TCP socket on ``host`` and a free port.

    Raises:
        ValueError: ``host`` is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, 0), family=family, backlog=2 * world_size + 16)
    except OSError as exc:
        raise ValueError(f"rank 0 cannot listen on {host} ({exc}): MASTER_ADDR must name the "
                         f"host that runs rank 0") from None


def operator_secret(env: Mapping[str, str]) -> bytes | None:
    """``HYBRIDFLOW_SECRET`` as bytes, or None when it is not set.

    Raises:
        ValueError: it is set but shorter than :data:`MIN_SECRET_BYTES`.
    """
    value = env.get(SECRET_ENV)
    if value is None:
        return None
    raw = value.encode()
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{SECRET_ENV} has {len(raw)} bytes; use at least {MIN_SECRET_BYTES} "
                         f"(e.g. the output of `python -c 'import secrets; "
                         f"print(secrets.token_hex(32))'`)")
    return raw


def default_store() -> dist.Store:
    """The store of the default process group (torchrun's TCPStore, or the harness's)."""
    # torch has no public accessor; this one has been stable since torch 1.x.
    return dist.distributed_c10d._get_default_store()


def open_controller(store: dist.Store, env: Mapping[str, str], world_size: int
                    ) -> tuple[socket.socket, Endpoint]:
    """Rank 0: bind the controller's socket and publish where it is (or why it is not).

    Raises:
        ValueError: no socket could be opened (the other ranks get the message through the
            store and fail too).
    """
    try:
        own = operator_secret(env)
        host = listen_host(env, world_size)
        server = open_server(host, world_size)
    except ValueError as exc:
        store.set(KEY, json.dumps({"error": str(exc)}))
        raise
    secret = own if own is not None else secrets.token_bytes(32)
    endpoint = Endpoint(host, server.getsockname()[1], secret)
    store.set(KEY, json.dumps({"host": endpoint.host, "port": endpoint.port,
                               "secret": None if own is not None else secret.hex()}))
    return server, endpoint


def lookup(store: dist.Store, env: Mapping[str, str], rank: int) -> Endpoint:
    """Rank r > 0: where the controller listens and the secret (waits for rank 0's record).

    Raises:
        ControllerError: rank 0 could not listen, or the ranks disagree on HYBRIDFLOW_SECRET.
    """
    record: Any = json.loads(store.get(KEY))
    if not isinstance(record, dict) or "error" in record:
        why = record.get("error") if isinstance(record, dict) else record
        raise ControllerError(f"rank 0 could not start the controller: {why}")
    own = operator_secret(env)
    if record["secret"] is None:
        if own is None:
            raise ControllerError(f"rank 0 uses {SECRET_ENV} but rank {rank} has none: set it "
                                  f"on every node")
        secret = own
    else:
        if own is not None:
            raise ControllerError(f"{SECRET_ENV} is set on rank {rank} but not on rank 0: set "
                                  f"it on every node, or on none")
        secret = bytes.fromhex(record["secret"])
    return Endpoint(str(record["host"]), int(record["port"]), secret)


def retract(store: dist.Store) -> None:
    """Rank 0, once every rank connected: remove the record (and the secret) from the store."""
    try:
        store.delete_key(KEY)
    except (RuntimeError, NotImplementedError):
        pass  # a store without deletion: the record stays, the port is closed by then
