"""Round trip of single-controller calls on 4 ranks, per transfer protocol, against Ray actors.

    python bench/dispatch.py [--json PATH] [--iters N]

Starts itself under ``torchrun --nproc_per_node 4`` and, for every protocol, measures the median
wall time of a blocking call (``group.execute``: issue + all replies, one round trip) with

* no arguments and no result (``noop_ms``), and
* a 1 MiB float32 Batch that every called rank returns (``payload_1mib_ms``; DP_COMPUTE gets a
  list of four 256 KiB batches), so the bytes travel there and back.

``future_noop_ms`` is the same no-op through a future (``call(...)`` then ``.get()``: two round
trips).  When ray is installed, the same two calls run on 4 Ray actors in the same run (the
reference that verl uses; payload split over the actors like DP_PROTO); otherwise ``"ray"`` is
null.  Output: a table, and with ``--json`` the file
``{"protocols": {NAME: {"noop_ms", "payload_1mib_ms", ...}}, "ray": {...} | null}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.peers import peer_missing  # noqa: E402
from bench.report import write_json  # noqa: E402
from bench.timing import median_time  # noqa: E402
from hybridflow_comm.layout import HybridLayout, ParallelLayout  # noqa: E402
from rlhf.controller import Batch, Controller, Worker, get_protocol, protocol, run  # noqa: E402

PROTOCOLS = ["ONE_TO_ALL", "3D_PROTO", "3D_ALL_MICRO_DP", "3D_PP_ONLY", "DP_PROTO",
             "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_METRIC", "RANK_ZERO"]
MIB_FLOATS = (1 << 20) // 4
WORLD = 4


def _method(name: str, proto: str, fn):
    """A distinct function object per protocol (the decorator marks the function itself)."""
    def method(self, *args):
        return fn(self, *args)
    method.__name__ = method.__qualname__ = name
    return protocol(get_protocol(proto))(method)


def _noop(self, *args):
    return None


def _echo(self, batch):
    return batch


class Bench(Worker):
    """One no-op and one echo method per protocol."""


for _p in PROTOCOLS:
    _key = _p.lower()
    setattr(Bench, f"noop_{_key}", _method(f"noop_{_key}", _p, _noop))
    setattr(Bench, f"echo_{_key}", _method(f"echo_{_key}", _p, _echo))


def _median_ms(fn, iters: int) -> float:
    return median_time(fn, iters, warmup=5)[0] * 1e3


def _program(out_path: str, iters: int):
    def program(ctl: Controller) -> None:
        group = ctl.group(Bench, HybridLayout(ParallelLayout(1, 2, 2), pp_g=1, tp_g=1))
        payload = Batch({"x": torch.randn(256, MIB_FLOATS // 256)})
        per_rank = [Batch({"x": torch.randn(256, MIB_FLOATS // 1024)}) for _ in range(WORLD)]
        results = {}
        for name in PROTOCOLS:
            key = name.lower()
            noop = getattr(Bench, f"noop_{key}")
            echo = getattr(Bench, f"echo_{key}")
            noop_args = ([None] * WORLD,) if name == "DP_COMPUTE" else ()
            arg = per_rank if name == "DP_COMPUTE" else payload
            results[name] = {
                "noop_ms": _median_ms(lambda: group.execute(noop, *noop_args), iters),
                "payload_1mib_ms": _median_ms(lambda: group.execute(echo, arg),
                                              max(10, iters // 10)),
                "future_noop_ms": _median_ms(lambda: group.call(noop, *noop_args).get(), iters),
            }
        with open(out_path, "w") as f:
            json.dump(results, f)

    return program


def _ray_bench(iters: int) -> dict | None:
    try:
        import ray
    except ImportError:
        return None

    @ray.remote(num_cpus=0)
    class Actor:
        def noop(self):
            return None

        def echo(self, x):
            return x

    ray.init(num_cpus=WORLD, include_dashboard=False, log_to_driver=False)
    try:
        actors = [Actor.remote() for _ in range(WORLD)]
        ray.get([a.noop.remote() for a in actors])
        chunks = torch.randn(MIB_FLOATS).chunk(WORLD)
        return {
            "noop_ms": _median_ms(lambda: ray.get([a.noop.remote() for a in actors]), iters),
            "payload_1mib_ms": _median_ms(
                lambda: ray.get([a.echo.remote(c) for a, c in zip(actors, chunks)]),
                max(10, iters // 10)),
        }
    finally:
        ray.shutdown()


def _table(result: dict) -> str:
    lines = [f"{'protocol':<20}{'no-op ms':>10}{'1 MiB ms':>10}{'future no-op ms':>17}"]
    for name, r in result["protocols"].items():
        lines.append(f"{name:<20}{r['noop_ms']:>10.3f}{r['payload_1mib_ms']:>10.3f}"
                     f"{r['future_noop_ms']:>17.3f}")
    ray = result["ray"]
    if ray is None:
        lines.append(f"{'ray (4 actors)':<20} {peer_missing('ray')}")
    else:
        lines.append(f"{'ray (4 actors)':<20}{ray['noop_ms']:>10.3f}{ray['payload_1mib_ms']:>10.3f}")
        lines.append(f"no-op speed-up over ray, DP_PROTO: "
                     f"{ray['noop_ms'] / result['protocols']['DP_PROTO']['noop_ms']:.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--iters", type=int, default=300, help="timed no-op calls per protocol")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set when under torchrun
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    if args.worker_out:
        return run(_program(args.worker_out, args.iters))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "protocols.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(WORLD), os.path.abspath(__file__), "--iters", str(args.iters),
               "--worker-out", out]
        proc = subprocess.run(cmd, cwd=ROOT)
        if proc.returncode != 0:
            print(f"error: the torchrun job failed with exit code {proc.returncode}",
                  file=sys.stderr)
            return proc.returncode
        with open(out) as f:
            protocols = json.load(f)
    result = {"protocols": protocols, "ray": _ray_bench(args.iters)}
    print(_table(result))
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
