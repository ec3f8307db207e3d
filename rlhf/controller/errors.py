"""Errors that reach the controller program from the workers."""

from __future__ import annotations


class ControllerError(RuntimeError):
    """Base of every failure the single controller reports."""


class WorkerError(ControllerError):
    """A worker method raised. Names the rank, role and method and carries the remote traceback.

    Attributes:
        rank: global rank of the failing worker.
        role: name of its worker group.
        method: name of the worker method.
        remote_traceback: the traceback text from the worker.
    """

    def __init__(self, rank: int, role: str, method: str, error: str, remote_traceback: str):
        self.rank, self.role, self.method = rank, role, method
        self.error, self.remote_traceback = error, remote_traceback
        super().__init__(f"worker rank {rank} (role {role!r}) failed in {role}.{method}: {error}\n"
                         f"--- remote traceback (rank {rank}) ---\n{remote_traceback}")


class RankLostError(ControllerError):
    """A rank went away (its connection closed: killed, crashed or exited) during the job."""

    def __init__(self, rank: int, during: str):
        self.rank = rank
        super().__init__(f"lost rank {rank}: its connection to the controller closed {during}")
