"""Run functions on N gloo ranks that are started once and reused (one pool per test module).

    pool = RankPool(4)
    results = pool.run(check_fn, arg)      # check_fn(rank, world_size, arg) on every rank
    pool.close()

``check_fn`` must be importable by module path (defined at module level).  A rank that raises
makes ``run`` raise :class:`RankError` naming the rank, the exception and the remote traceback.
A rank that dies, a pool whose ranks are not up within ``start_timeout_s``, or a call that
does not finish within ``timeout_s`` (counted from when the ranks are up, so a slow start on a
loaded machine does not eat into it) raises too instead of hanging; the pool is then restarted
on the next call, since its ranks may be stuck in a collective.

``RankPool(4, nccl_rules=True)`` (or ``HYBRIDFLOW_TEST_NCCL_RULES=1`` in the environment of
pytest, for every pool) installs :mod:`hybridflow_comm.nccl_rules` in every rank: each call then runs
under NCCL's rules, on gloo.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

_CTX = mp.get_context("spawn")


class RankError(RuntimeError):
    """A rank of the pool failed (raised, died or timed out)."""

    def __init__(self, rank: int | None, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def _worker_main(rank: int, world_size: int, store_path: str, conn, threads: int,
                 pg_timeout_s: float, nccl_rules: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    if nccl_rules:
        from hybridflow_comm.nccl_rules import install

        install("cpu")
    conn.send(("ok", None))  # up: the pool's start-up wait ends here
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            result = fn(rank, world_size, *args, **kwargs)
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the interpreter's own teardown of a long-used rank takes seconds


class RankPool:
    """``world_size`` gloo ranks in spawned processes, reused across calls.

    Args:
        world_size: number of ranks.
        timeout_s: default time limit of one :meth:`run`, once the ranks are up.
        start_timeout_s: time limit of the ranks' start (imports, process group).
        pg_timeout_s: collective timeout inside the ranks.
        nccl_rules: install :mod:`hybridflow_comm.nccl_rules` in every rank (default: when
            ``HYBRIDFLOW_TEST_NCCL_RULES=1``).
    """

    def __init__(self, world_size: int, timeout_s: float = 180.0, start_timeout_s: float = 300.0,
                 pg_timeout_s: float = 60.0, nccl_rules: bool | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.pg_timeout_s = pg_timeout_s
        self.nccl_rules = (os.environ.get("HYBRIDFLOW_TEST_NCCL_RULES") == "1"
                           if nccl_rules is None else nccl_rules)
        self._procs: list = []
        self._conns: list = []
        self._tmpdir: tempfile.TemporaryDirectory | None = None

    def _start(self) -> None:
        self._tmpdir = tempfile.TemporaryDirectory(prefix="hf_pool_")
        store_path = os.path.join(self._tmpdir.name, "store")
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        for rank in range(self.world_size):
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(target=_worker_main, daemon=True,
                                args=(rank, self.world_size, store_path, child, threads,
                                      self.pg_timeout_s, self.nccl_rules))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("start-up", time.monotonic() + self.start_timeout_s)

    def run(self, fn, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(fn.__name__, time.monotonic() + (timeout_s or self.timeout_s))

    def _collect(self, what: str, deadline: float) -> list:
        """Every rank's answer to ``what`` by ``deadline`` (raise, after killing the ranks,
        on an error, a death or the deadline)."""
        results: dict[int, object] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._abort()
                raise RankError(None, f"{what} timed out on ranks {sorted(pending)}")
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = wait(list(pending.values()) + list(sentinels), timeout=remaining)
            for obj in ready:
                rank = sentinels.get(obj)
                if rank is None:
                    rank = next(r for r, c in pending.items() if c is obj)
                if rank not in pending:
                    continue
                try:
                    msg = self._conns[rank].recv() if self._conns[rank].poll() else None
                except EOFError:
                    msg = None
                if msg is None:  # the process exited without answering
                    self._procs[rank].join(timeout=5)
                    code = self._procs[rank].exitcode
                    self._abort()
                    raise RankError(rank, f"rank {rank} died (exit code {code}) in {what}")
                del pending[rank]
                if msg[0] == "err":
                    self._abort()
                    raise RankError(rank, f"rank {rank} raised {msg[1]} in {what}\n"
                                          f"--- remote traceback (rank {rank}) ---\n{msg[2]}")
                results[rank] = msg[1]
        return [results[r] for r in range(self.world_size)]

    def _abort(self) -> None:
        """Kill every rank: after a failure the others may be stuck in a collective."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        self._reset()

    def _reset(self) -> None:
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def close(self) -> None:
        """Stop the ranks cleanly (kill them if they do not stop in time)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._reset()
