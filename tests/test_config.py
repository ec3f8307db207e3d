"""Config dataclasses, recipes, key=value overrides and validate_for_world."""

import ast
import inspect

import pytest

from rlhf import config as C
from rlhf import config_roles, config_run, world_plan
from rlhf.config import load_config
from rlhf.programs import algorithm_names
from rlhf.world_plan import validate_for_world


@pytest.mark.parametrize("name", C.recipe_names())
def test_recipes_load_validate_and_roundtrip(name, tmp_path):
    cfg = load_config([f"algo={name}"])
    assert cfg.algo.name == name
    for world in (2, 4):                               # CI on 2 ranks, the main job on 4
        plan = validate_for_world(cfg, world)
        assert set(plan.roles) == set(cfg.roles)
        for rp in plan.roles.values():
            assert rp.layout.world_size == len(rp.pool)
    path = tmp_path / "c.yaml"
    C.save_config(cfg, str(path))
    assert load_config([f"recipe={path}"]) == cfg
    assert C.config_from_dict(cfg.to_dict()) == cfg


def test_shipped_recipes_and_roles():
    assert set(C.recipe_names()) >= set(algorithm_names())
    assert load_config([]).algo.name == "ppo"           # default recipe
    assert load_config(["algo=ppo"]).roles == ("actor", "critic", "reference")
    assert load_config(["algo=remax"]).roles == ("actor", "reference")
    assert load_config(["algo=safe_rlhf"]).roles == ("actor", "critic", "cost_critic", "reference")
    assert "reward_model" in load_config(["reward.kind=both"]).roles
    assert "reference" not in load_config(["algo=grpo", "algo.kl_mode=none"]).roles


def test_overrides_and_derived_sizes():
    cfg = load_config(["algo=ppo", "actor.optim.lr=1e-5", "data.prompts_per_iter=32",
                       "data.samples_per_prompt=2", "actor.loss.clip_ratio_c=3",
                       "reward.rule_weights.format=0.5", "critic.model.hidden_size=32",
                       "log.tensorboard=false", "algo.lagrange_max=null"])
    assert cfg.actor.optim.lr == 1e-5 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.data.rollout_batch_size == 64 and cfg.data.num_mini_batches == 8
    assert cfg.actor.loss.clip_ratio_c == 3.0 and cfg.reward.rule_weights["format"] == 0.5
    assert cfg.model_of("critic").hidden_size == 32 and cfg.model_of("reference") == cfg.actor.model
    assert cfg.log.tensorboard is False and cfg.algo.lagrange_max is None
    plan = validate_for_world(cfg, 4)
    assert plan.roles["actor"].grad_accum == 8 // (2 * 2)


def test_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown config key 'actor.lr' \(did you mean "
                                         r"'actor.optim.lr'\?\).*valid keys of section 'actor': "
                                         r"model, layout, optim, loss"):
        load_config(["actor.lr=1"])
    with pytest.raises(ValueError, match=r"'actor.optim.lrr' \(did you mean 'actor.optim.lr'"):
        load_config(["actor.optim.lrr=1"])
    with pytest.raises(ValueError, match=r"'algo.clip_ratio' \(did you mean "
                                         r"'actor.loss.clip_ratio'"):
        load_config(["algo.clip_ratio=0.1"])
    with pytest.raises(ValueError, match="unknown config key 'iters'.*iterations"):
        load_config(["iters=3"])
    with pytest.raises(ValueError, match=r"config key 'data.prompts_per_iter' expects int, got "
                                         r"'many' \(str\)"):
        load_config(["data.prompts_per_iter=many"])
    with pytest.raises(ValueError, match=r"config key 'actor.optim.lr' expects float, got "
                                         r"\[1, 2\] \(list\)"):
        load_config(["actor.optim.lr=[1, 2]"])
    with pytest.raises(ValueError, match=r"'log.tensorboard' expects bool, got 'maybe'"):
        load_config(["log.tensorboard=maybe"])
    with pytest.raises(ValueError, match="'actor.optim.lr' is a value"):
        load_config(["actor.optim.lr.x=1"])
    with pytest.raises(ValueError, match="not key=value"):
        load_config(["actor.optim.lr"])
    with pytest.raises(ValueError, match=r"placement.pool_sizes='\{actor:' is not a valid YAML "
                                         r"value.*quote the whole argument"):
        load_config(["placement.pool_sizes={actor:"])
    with pytest.raises(ValueError, match="algo='dpo' has no recipe"):
        load_config(["algo=dpo"])
    with pytest.raises(ValueError, match=r"placement.mode='everywhere' must be one of"):
        load_config(["placement.mode=everywhere"])
    with pytest.raises(ValueError, match=r"algo.kl_estimator='k9'"):
        load_config(["algo.kl_estimator=k9"])
    with pytest.raises(ValueError, match=r"unknown components \['bleu'\]"):
        load_config(["reward.rule_weights.bleu=1"])


def test_batch_size_errors_name_values_and_fix():
    with pytest.raises(ValueError, match=r"16 x samples_per_prompt=1 = 16 is not a multiple of "
                                         r"mini_batch_size=5; choose mini_batch_size from \[1, 2, 4, 8, 16\]"):
        load_config(["data.mini_batch_size=5"])
    with pytest.raises(ValueError, match="mini_batch_size=8 is not a multiple of micro_batch_size=3"):
        load_config(["data.micro_batch_size=3"])
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        load_config(["algo=grpo", "data.samples_per_prompt=1", "data.mini_batch_size=8"])
    cfg = load_config(["data.micro_batch_size=4"])
    with pytest.raises(ValueError, match=r"critic: mini_batch_size=8 must be a multiple of dp=4 "
                                         r"x micro_batch_size=4 = 16"):
        validate_for_world(cfg, 4)
    cfg = load_config(["algo=rloo", "data.prompts_per_iter=3", "data.samples_per_prompt=2",
                       "data.mini_batch_size=6", "data.micro_batch_size=1"])
    with pytest.raises(ValueError, match="reference: rollout batch 6 does not split over dp=4"):
        validate_for_world(cfg, 4)
    cfg = load_config(["algo=rloo", "data.prompts_per_iter=3", "data.samples_per_prompt=2",
                       "data.mini_batch_size=6", "data.micro_batch_size=1",
                       "reference.layout.tp=2"])
    with pytest.raises(ValueError, match="actor: rollout batch 6 does not split over 4 "
                                         "generation replicas"):
        validate_for_world(cfg, 4)
    cfg = load_config(["algo=remax", "data.prompts_per_iter=2", "data.samples_per_prompt=4",
                       "data.mini_batch_size=8"])
    with pytest.raises(ValueError, match="remax: the greedy baseline batch prompts_per_iter=2"):
        validate_for_world(cfg, 4)


def test_layout_errors():
    with pytest.raises(ValueError, match=r"actor.layout pp=1 x tp=2 = 2 does not divide its pool "
                                         r"of 3 ranks"):
        validate_for_world(load_config([]), 3)
    with pytest.raises(ValueError, match=r"dp=3 = 6 ranks but its pool has 4; set "
                                         r"actor.layout.dp=2"):
        validate_for_world(load_config(["actor.layout.dp=3"]), 4)
    with pytest.raises(ValueError, match="actor: tp=4 must divide num_kv_heads=2"):
        validate_for_world(load_config(["actor.layout.tp=4"]), 4)
    with pytest.raises(ValueError, match="actor.layout: tp_g=3 must divide the training tp=2"):
        validate_for_world(load_config(["actor.layout.gen_tp=3"]), 4)
    with pytest.raises(ValueError, match="max_seq_len=10 < max_prompt_len"):
        validate_for_world(load_config(["actor.model.max_seq_len=10"]), 4)
    with pytest.raises(ValueError, match="world_size=0"):
        validate_for_world(load_config([]), 0)


def test_expert_parallel_layouts():
    moe = ["actor.model.num_experts=4", "algo=grpo", "actor.layout.tp=1"]
    plan = validate_for_world(load_config(moe + ["actor.layout.ep=2", "reference.layout.ep=4",
                                                 "reference.layout.tp=1"]), 4)
    actor, ref = plan.roles["actor"], plan.roles["reference"]
    assert (actor.ep, actor.gen_ep, ref.ep) == (2, 1, 4)
    lay = actor.experts(4)
    assert (lay.hybrid, lay.ep, lay.gen_ep) == (actor.layout, 2, 1)
    assert validate_for_world(load_config(moe), 4).roles["actor"].experts(4) is None
    gen_ep = validate_for_world(load_config(moe + [
        "actor.layout.tp=2", "actor.layout.gen_tp=2", "actor.layout.ep=4",
        "actor.layout.gen_ep=2"]), 4).roles["actor"].experts(4)
    assert (gen_ep.ep, gen_ep.gen_ep, gen_ep.gen_experts(0)) == (4, 2, (0, 2))  # own, then free
    disaggregated = validate_for_world(load_config(moe + [
        "actor.layout.ep=2", "placement.mode=disaggregated",
        "placement.pool_sizes={actor: 2, rollout: 2}"]), 4).roles["actor"]
    assert (disaggregated.ep, disaggregated.pool) == (2, (0, 1))
    vllm = validate_for_world(load_config(moe + ["actor.layout.ep=2", "rollout.engine=vllm"]),
                              4).roles["actor"]
    assert (vllm.ep, vllm.gen_ep) == (2, 1)  # vLLM is fed every expert whole
    refused = {"actor.layout.ep=2, gen_ep=1 but the model has no experts":
               ["algo=grpo", "actor.layout.ep=2"],
               "actor.layout: ep=3 must divide the tp x dp = 4 ranks":
               moe + ["actor.layout.ep=3"],
               "actor.layout: ep=8 must divide the tp x dp = 4 ranks": moe + ["actor.layout.ep=8"],
               "actor.layout: gen_ep=2 must divide tp_g=1":
               moe + ["actor.layout.ep=2", "actor.layout.gen_ep=2"],
               "reference.layout.gen_ep=2: only the actor generates":
               moe + ["reference.layout.gen_ep=2"],
               "actor.layout.gen_ep=2 with rollout.engine=vllm: vLLM takes every expert whole":
               moe + ["actor.layout.tp=2", "actor.layout.gen_tp=2", "actor.layout.ep=2",
                      "actor.layout.gen_ep=2", "rollout.engine=vllm"],
               "actor.layout.gen_ep=2 with placement.mode=disaggregated: the rollout pool":
               moe + ["actor.layout.tp=2", "actor.layout.ep=2", "actor.layout.gen_ep=2",
                      "placement.mode=disaggregated",
                      "placement.pool_sizes={actor: 2, rollout: 2}"]}
    for message, overrides in refused.items():
        with pytest.raises(ValueError, match=message):
            validate_for_world(load_config(overrides), 4)
    with pytest.raises(ValueError, match="ep=0 must be > 0"):
        load_config(moe + ["actor.layout.ep=0"])
    lora = validate_for_world(load_config(moe + ["actor.layout.ep=2", "actor.lora.rank=4"]), 4)
    assert lora.roles["actor"].ep == 2  # LoRA on the attention of an expert-parallel model


def test_placements():
    cfg = load_config(["placement.mode=split", "placement.pool_sizes={actor: 2, critic: 2}"])
    plan = validate_for_world(cfg, 4)
    assert plan.pools == {"actor": (0, 1), "critic": (2, 3)}
    assert plan.roles["reference"].pool == (0, 1) and plan.roles["critic"].pool == (2, 3)
    assert plan.roles["actor"].dp == 1 and plan.roles["critic"].dp == 2
    with pytest.raises(ValueError, match=r"sum to 3 but world_size=4"):
        validate_for_world(load_config(["placement.mode=split",
                                        "placement.pool_sizes.actor=2",
                                        "placement.pool_sizes.critic=1"]), 4)
    with pytest.raises(ValueError, match="needs a role besides actor/reference"):
        validate_for_world(load_config(["algo=grpo", "placement.mode=split"]), 4)
    cfg = load_config(["placement.mode=standalone", "actor.layout.gen_tp=2",
                       "placement.pool_sizes={actor: 2, critic: 1, reference: 1}"])
    plan = validate_for_world(cfg, 4)
    assert [plan.roles[r].pool for r in cfg.roles] == [(0, 1), (2,), (3,)]
    with pytest.raises(ValueError, match=r"needs placement.pool_sizes with keys \['actor', "
                                         r"'critic', 'reference'\]"):
        validate_for_world(load_config(["placement.mode=standalone"]), 4)


def test_every_config_field_has_a_docstring():
    classes = [n for module in (C, config_roles, config_run, world_plan)
               for n in ast.parse(inspect.getsource(module)).body
               if isinstance(n, ast.ClassDef)
               and any(getattr(d, "func", d).__dict__.get("id") == "dataclass"
                       for d in n.decorator_list)]
    assert len(classes) >= 10
    for cls in classes:
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                ok = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                assert ok, f"{cls.name}.{node.target.id} has no docstring"


def test_recipe_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- algo\n- ppo\n")
    with pytest.raises(ValueError, match=r"recipe=.*list.yaml' must be a YAML mapping of config "
                                         r"sections, got a list"):
        load_config([f"recipe={path}"])
    with pytest.raises(ValueError, match=r"recipe='/nonexistent.yaml' is not a file"):
        load_config(["recipe=/nonexistent.yaml"])


def test_mappings_are_replaced_sections_merged():
    # a mapping-valued field is replaced by an override (not unioned with the recipe's)
    cfg = load_config(["reward.rule_weights={partial: 1}"])
    assert cfg.reward.rule_weights == {"partial": 1.0}
    # a section given as a mapping sets its fields; a null optional section starts at defaults
    cfg = load_config(["critic.model={hidden_size: 32}", "actor.optim={lr: 0.5}"])
    assert cfg.critic.model == C.ModelConfig(hidden_size=32)
    assert cfg.actor.optim.lr == 0.5 and cfg.actor.optim.betas == (0.9, 0.999)
    assert load_config(["algo=grpo", "actor.optim.betas=[0.8, 0.9]"]).actor.optim.betas == \
        (0.8, 0.9)


def test_registry_drives_names_roles_and_checks():
    from rlhf.programs import ALGORITHMS, algorithm

    assert set(algorithm_names()) == {
        "ppo", "remax", "safe_rlhf", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
        "dr_grpo", "grpo_passk", "opo", "dapo", "gspo", "cispo", "clip_cov", "kl_cov", "gmpo",
        "sapo", "gpg"}
    for name, spec in ALGORITHMS.items():
        cfg = load_config([f"algo={name}"])
        kl = {"reference"} if cfg.algo.kl_mode != "none" else set()
        want = {"actor", *kl, *spec.critics}
        assert set(cfg.roles) == want, name        # shipped recipes: rule rewards
        assert callable(spec.program) and callable(spec.advantage)
    assert algorithm("remax").generations == 2 and algorithm("ppo").generations == 1
    with pytest.raises(ValueError, match=r"algo='dpo' is not a registered algorithm"):
        algorithm("dpo")
    with pytest.raises(ValueError, match=r"algo.name='dpo' must be one of"):
        load_config(["algo=ppo", "algo.name=dpo"])


def test_readme_example_adds_an_algorithm_in_one_file(tmp_path):
    """The README's "Add an algorithm" module, run as written: registered, loadable from a
    recipe, its roles derived, its estimator computing on a batch."""
    import pathlib
    import re

    import torch

    from rlhf.controller import Batch
    from rlhf.programs import ALGORITHMS, algorithm

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(# rlhf/programs/mean_baseline.py\n.*?)```", readme, re.S)[1]
    recipe = tmp_path / "mean_baseline.yaml"
    recipe.write_text((pathlib.Path(C.RECIPES_DIR) / "reinforce_pp.yaml").read_text()
                      .replace("name: reinforce_pp", "name: mean_baseline"))
    try:
        exec(compile(code, "mean_baseline.py", "exec"), {"__name__": "mean_baseline"})
        cfg = load_config([f"recipe={recipe}"])
        assert cfg.algo.name == "mean_baseline" and cfg.roles == ("actor", "reference")
        assert validate_for_world(cfg, 2).roles.keys() == {"actor", "reference"}
        mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
        from tests.test_algos import _iteration
        out = algorithm("mean_baseline").advantage(
            Batch({"token_level_rewards": rewards, "response_mask": mask}),
            _iteration("mean_baseline"))
        from rlhf.algos import reinforce_pp
        want, _ = reinforce_pp(rewards - rewards.mean(), mask, 1.0)
        torch.testing.assert_close(out["advantages"], want)
    finally:
        ALGORITHMS.pop("mean_baseline", None)
