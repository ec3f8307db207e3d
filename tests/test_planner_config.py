"""Planner <-> rlhf.config: placement=auto resolved into runnable overrides; the CLI."""

import json

import pytest

from rlhf import plan as plan_cli
from rlhf.config import load_config
from rlhf.planner.config_bridge import plan_for_config, predict_config, resolve_config
from rlhf.planner.profile import load_profile
from rlhf.planner.report import placement_kind
from rlhf.world_plan import validate_for_world


@pytest.mark.parametrize("algo", ["ppo", "grpo", "remax", "safe_rlhf"])
@pytest.mark.parametrize("world", [2, 4])
def test_plan_for_config_is_runnable(algo, world):
    cfg = load_config([f"algo={algo}", "placement.mode=auto"])
    plan = plan_for_config(cfg, world, "cpu")
    resolved = resolve_config(cfg, world)
    wp = validate_for_world(resolved, world)
    assert set(wp.roles) == set(cfg.roles)
    assert resolved.placement.mode == plan.overrides["placement.mode"] != "auto"
    for role, rp in wp.roles.items():
        s = plan.mapping.set_of(role).strategies[role]
        assert (rp.pp, rp.tp, rp.dp, rp.gen_pp, rp.gen_tp, rp.ep, rp.gen_ep) == \
            (s.pp, s.tp, s.dp, s.pp_g, s.tp_g, s.ep, s.gen_ep)
    assert all(placement_kind(m.placement) != "mixed" or "reference" not in cfg.roles
               for m in plan.candidates)


MOE = ["algo=grpo", "placement.mode=auto", "actor.model.num_experts=4",
       "actor.model.num_experts_per_tok=2"]


def test_planner_chooses_expert_parallelism_the_runtime_accepts():
    """Where memory is short, a mixture of experts' plan trains its actor with ep > 1: the
    overrides name it, the world plan accepts it, predict_config prices it the same and counts
    its all-to-all bytes; with vLLM rollouts (fed every expert whole) the same."""
    prof = load_profile("cpu")
    chosen, chosen_vllm = [], []
    for gb in (0.005, 0.003, 0.0015):
        cfg = load_config(MOE)
        plan = plan_for_config(cfg, 4, prof.with_memory(gb))
        s = plan.mapping.set_of("actor").strategies["actor"]
        assert (plan.overrides["actor.layout.ep"], plan.overrides["actor.layout.gen_ep"]) == \
            (s.ep, s.gen_ep)
        resolved = resolve_config(cfg, 4, prof.with_memory(gb))
        actor = validate_for_world(resolved, 4).roles["actor"]
        assert (actor.ep, actor.gen_ep) == (s.ep, s.gen_ep)
        again = predict_config(resolved, 4, prof.with_memory(gb))
        assert again.total == pytest.approx(plan.mapping.total, rel=1e-12)
        a2a = again.set_of("actor").all_to_all_bytes["actor"]
        assert (a2a > 0) == (s.ep > 1)
        chosen.append(s.ep)
        vllm = load_config(MOE + ["rollout.engine=vllm"])
        ep = plan_for_config(vllm, 4, prof.with_memory(gb)).mapping.set_of(
            "actor").strategies["actor"].ep
        resolved = resolve_config(vllm, 4, prof.with_memory(gb))
        assert validate_for_world(resolved, 4).roles["actor"].ep == ep
        chosen_vllm.append(ep)
    assert max(chosen) > 1 and max(chosen_vllm) > 1, (chosen, chosen_vllm)


def test_auto_must_be_resolved_and_predict_matches():
    with pytest.raises(ValueError, match="placement.mode='auto' must be resolved"):
        validate_for_world(load_config(["placement.mode=auto"]), 4)
    cfg = load_config(["algo=ppo", "placement.mode=auto"])
    plan = plan_for_config(cfg, 4, "cpu")
    again = predict_config(resolve_config(cfg, 4), 4, "cpu")
    assert abs(again.total - plan.mapping.total) < 1e-12


def test_cli_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = plan_cli.main(["--devices", "16", "--model", "7b", "--top", "3", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "best mapping" in text and "(pp, tp, dp)" in text
    data = json.loads(out.read_text())
    assert len(data["top"]) == 3 and data["best"] == data["top"][0]
    assert sum(s["devices"] for s in data["best"]["sets"]) == 16
    assert plan_cli.main(["--devices", "4", "--model", "99b"]) == 2
    assert "model='99b' is not a preset" in capsys.readouterr().err
    assert plan_cli.main(["--devices", "1", "--model", "70b"]) == 1   # does not fit one GPU
