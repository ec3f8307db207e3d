"""Futures: what a worker-group call returns at once.

A :class:`Future` knows the call's plan and, once the ranks answered, the metadata of each
collected output (rows, field shapes) -- never the payload.  Passing it to another call makes
the consumer ranks fetch their rows from the producer ranks (the controller only computes the
row plan from the metadata); :meth:`Future.get` is the one place where a value comes to the
controller.

Padding.  A split call pads its batch from ``n`` to ``padded`` rows; the concatenated outputs
then end with ``pad_out = (padded - n) * rows_out / padded`` padding rows (outputs may have a
fixed number of rows per input row, e.g. several samples per prompt), which :meth:`get`
removes and which a consumer never reads.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from rlhf.controller.batch import PAD_KEY, Batch
from rlhf.controller.calls import CallIssuer, CallState
from rlhf.controller.errors import ControllerError
from rlhf.controller.messages import Done
from rlhf.controller.protocols import CONCAT, LIST, Plan


class Future:
    """Result of a worker-group call, resolved lazily.

    Attributes:
        what: ``"role.method"``.
        plan: the protocol plan of the call.
        collect_ranks: global ranks whose outputs make the result, in order.
    """

    def __init__(self, controller: CallIssuer, state: CallState, plan: Plan,
                 collect_ranks: tuple[int, ...], rows_in: int | None, padded_in: int | None
                 ) -> None:
        self._ctl = controller
        self._state = state
        self.what = state.what
        self.plan = plan
        self.collect_ranks = collect_ranks
        self._rows_in, self._padded_in = rows_in, padded_in
        self._value: Any = None
        self._has_value = False
        weakref.finalize(self, controller.release, state.cid, collect_ranks)

    @property
    def oid(self) -> int:
        """Id under which the collect ranks store their outputs."""
        return self._state.cid

    def done(self) -> bool:
        """True once every called rank answered (reads arrived replies, never blocks)."""
        self._ctl.poll()
        return self._state.done

    def wait(self) -> Future:
        """Block until every called rank finished the call (raises the call's errors)."""
        self._ctl.wait(self._state)
        return self

    def metas(self) -> list[dict]:
        """Output metadata of each collect rank, in collect order (waits)."""
        return [d.meta for d in self._dones()]

    def counts(self) -> list[int]:
        """Rows of each collected output (concat futures of batches)."""
        metas = self.metas()
        if self.plan.collect != CONCAT or any(m.get("kind") != "batch" for m in metas):
            raise ValueError(f"{self.what}: only a concatenated Batch output has row counts; "
                             f"this call collects {self.plan.collect} of "
                             f"{[m.get('kind') for m in metas]}")
        return [m["size"] for m in metas]

    def pad_rows(self) -> int:
        """Padding rows at the end of the concatenated outputs."""
        if self.plan.collect != CONCAT or self._rows_in is None or self._padded_in is None:
            return 0
        pad_in = self._padded_in - self._rows_in
        if pad_in == 0:
            return 0
        rows_out = sum(m["size"] or 0 for m in self.metas() if m.get("size") is not None)
        if rows_out % self._padded_in:
            raise ControllerError(
                f"{self.what}: {rows_out} output rows for {self._padded_in} padded input rows; "
                f"cannot remove the {pad_in} padding rows (outputs must have a fixed number of "
                f"rows per input row)")
        return pad_in * (rows_out // self._padded_in)

    def __len__(self) -> int:
        """Valid rows of a concatenated Batch output (metadata only)."""
        return sum(self.counts()) - self.pad_rows()

    def get(self) -> Any:
        """The value: concatenated (padding removed), a list, or the single output."""
        if self._has_value:
            return self._value
        dones = self._dones()
        missing = [d.rank for d in dones if not d.has_value]
        fetched = self._ctl.fetch(self.oid, missing, self.what).replies if missing else {}
        self._value = self._combine([d.value if d.has_value else fetched[d.rank].value
                                     for d in dones])
        self._has_value = True
        return self._value

    def _dones(self) -> list[Done]:
        """The collect ranks' replies, in collect order (waits)."""
        self.wait()
        return [self._state.replies[r] for r in self.collect_ranks]  # a Call is answered Done

    def _combine(self, values: list) -> Any:
        if self.plan.collect == LIST:
            return values
        if self.plan.collect != CONCAT:
            return values[0]
        if all(v is None for v in values):
            return None  # methods run for their effect: nothing to concatenate
        pad = self.pad_rows()
        if all(isinstance(v, Batch) for v in values):
            out = Batch.concat(values)
            out = out.rows(slice(0, len(out) - pad))
            out.meta.pop(PAD_KEY, None)
            return out
        if all(isinstance(v, torch.Tensor) for v in values):
            out = torch.cat(values)
            return out[:out.shape[0] - pad]
        if all(isinstance(v, list) for v in values):
            out = [x for v in values for x in v]
            return out[:len(out) - pad]
        raise ControllerError(f"{self.what}: cannot concatenate outputs of types "
                              f"{[type(v).__name__ for v in values]}")

    def __repr__(self) -> str:
        return f"Future({self.what}, oid={self.oid}, done={self._state.done})"
