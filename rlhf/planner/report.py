"""Plans as text and JSON: the best mapping, the top-candidates table, placement kinds."""

from __future__ import annotations

from rlhf.planner.dataflow import STAGES
from rlhf.planner.search import Mapping

GIB = 2**30


def placement_kind(placement: tuple[tuple[str, ...], ...]) -> str:
    """``colocated`` (one set), ``standalone`` (one model per set), ``split`` (actor and
    reference together, every other model in a second set: the paper's split), else ``mixed``."""
    if len(placement) == 1:
        return "colocated"
    if all(len(b) == 1 for b in placement):
        return "standalone"
    blocks = {frozenset(b) for b in placement}
    if len(placement) == 2 and frozenset(("actor", "reference")) in blocks:
        return "split"
    return "mixed"


def mapping_to_dict(m: Mapping) -> dict:
    return {
        "total_s": m.total,
        "kind": placement_kind(m.placement),
        "stages_s": dict(m.stages),
        "sets": [{
            "models": list(s.models),
            "devices": s.devices,
            "peak_gib": s.peak_bytes / GIB,
            "strategies": {r: {"pp": st.pp, "tp": st.tp, "dp": st.dp, "pp_g": st.pp_g,
                               "tp_g": st.tp_g, "dp_g": st.dp_g, "ep": st.ep,
                               "gen_ep": st.gen_ep}
                           for r, st in s.strategies.items()},
            "times_s": s.times,
            "all_to_all_gib": {r: b / GIB for r, b in s.all_to_all_bytes.items()},
        } for s in m.sets],
    }


def format_best(m: Mapping) -> str:
    """The chosen mapping, one line per colocated set and model."""
    lines = [f"best mapping ({placement_kind(m.placement)}): predicted {m.total:.3g} s per "
             f"iteration = " + " + ".join(f"{st} {m.stages[st]:.3g}" for st in STAGES)]
    for s in m.sets:
        lines.append(f"  set {{{', '.join(s.models)}}} on {s.devices} devices "
                     f"(peak {s.peak_bytes / GIB:.3g} GiB/device)")
        for r, st in s.strategies.items():
            gen = f"  generation (pp_g, tp_g) = ({st.pp_g}, {st.tp_g}), dp_g = {st.dp_g}" \
                if s.times[r]["generation"] else ""
            ep = f", ep = {st.ep} (all-to-all {s.all_to_all_bytes.get(r, 0.0) / GIB:.3g} " \
                f"GiB/device per iteration)" if st.ep > 1 else ""
            lines.append(f"    {r:<12} training (pp, tp, dp) = ({st.pp}, {st.tp}, {st.dp}){ep}"
                         f"{gen}")
    return "\n".join(lines)


def format_table(mappings: list[Mapping]) -> str:
    """Top candidates: placement with devices, per-stage and total predicted seconds."""
    rows = [["#", "kind", "sets:devices", *STAGES, "total", "strategies (pp-tp-dp -> pp_g-tp_g)"]]
    for i, m in enumerate(mappings, 1):
        strat = ", ".join(f"{r} {st.short()}" for s in m.sets for r, st in s.strategies.items())
        rows.append([str(i), placement_kind(m.placement), m.label(),
                     *(f"{m.stages[st]:.3g}" for st in STAGES), f"{m.total:.3g}", strat])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
