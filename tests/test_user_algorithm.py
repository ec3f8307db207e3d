"""A user's algorithm from a file (``algo.module``): the README's example, loaded as a run
loads it, its loss against the formula, and the errors of a bad file or name.  The same file
trains end to end in tests/test_rlhf_runtime.py."""

from __future__ import annotations

import math
import pathlib
import re

import pytest
import torch

from rlhf.config import load_config
from rlhf.world_plan import validate_for_world

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_algorithm() -> str:
    """The ``my_algo.py`` block of the README."""
    return re.search(r"```python\n(# my_algo.py\n.*?)```", README.read_text(), re.S)[1]


@pytest.fixture
def user_file(tmp_path):
    from rlhf.algos import POLICY_LOSSES
    from rlhf.programs import ALGORITHMS
    from rlhf.programs import registry

    path = tmp_path / "my_algo.py"
    path.write_text(readme_algorithm())
    yield str(path)
    ALGORITHMS.pop("my_grpo", None)
    POLICY_LOSSES.pop("truncated_pg", None)
    registry._USER_MODULES.pop(str(path.resolve()), None)


def test_readme_algorithm_loads_and_its_loss_is_the_formula(user_file):
    from rlhf.algos import get_policy_loss
    from rlhf.programs import algorithm

    cfg = load_config(["algo=my_grpo", f"algo.module={user_file}", "actor.loss.clip_ratio=0.3"])
    assert cfg.algo.name == "my_grpo" and cfg.algo.module == user_file
    assert cfg.data.samples_per_prompt == load_config(["algo=grpo"]).data.samples_per_prompt
    assert validate_for_world(cfg, 2).roles.keys() == set(cfg.roles)
    spec = algorithm("my_grpo")
    assert spec.grouped and spec.policy_loss == "truncated_pg"
    # built again (every rank builds the config; tests build it many times): no re-import
    assert load_config(["algo=my_grpo", f"algo.module={user_file}"]).algo.name == "my_grpo"

    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 4, generator=g, dtype=torch.float64) - 1
    old = logp.detach() + 0.5 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    old[0, 3] = float("nan")  # padding garbage
    leaf = logp.clone().requires_grad_(True)
    loss, _ = get_policy_loss(spec.policy_loss)(leaf, old, adv, mask, cfg=cfg.actor.loss,
                                                loss_agg_mode="token-mean", denominator=None)
    loss.backward()
    # the formula, token by token: mean over valid tokens of -min(r, 1.3) * A * log pi
    n = int(mask.sum())
    want, grad = 0.0, torch.zeros_like(logp)
    for b in range(3):
        for t in range(4):
            if mask[b, t]:
                w = min(math.exp(float(logp[b, t] - old[b, t])), 1.3)
                want += -w * float(adv[b, t]) * float(logp[b, t]) / n
                grad[b, t] = -w * float(adv[b, t]) / n
    assert math.isclose(float(loss), want, rel_tol=1e-12)
    torch.testing.assert_close(leaf.grad, grad, rtol=1e-12, atol=1e-15)


def test_user_loss_under_a_shipped_algorithm(user_file):
    cfg = load_config(["algo=rloo", f"algo.module={user_file}", "actor.loss.mode=truncated_pg"])
    assert cfg.algo.name == "rloo" and cfg.actor.loss.mode == "truncated_pg"


def test_bad_modules_and_names(tmp_path, user_file):
    with pytest.raises(ValueError, match=r"algo.module='nope.py' must be an existing .py file"):
        load_config(["algo=grpo", "algo.module=nope.py"])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match=r"algo.module=.*importing .*broken.py failed: "
                                         r"RuntimeError: boom"):
        load_config(["algo=grpo", f"algo.module={broken}"])
    with pytest.raises(ValueError, match=r"algo='my_grpo' has no recipe"):
        load_config(["algo=my_grpo"])                    # the file not given: not registered
    with pytest.raises(ValueError, match=r"actor.loss.mode='nope' is not a registered policy "
                                         r"loss; choose from \[.*'gspo'"):
        load_config(["algo=grpo", "actor.loss.mode=nope"])


def test_the_former_module_of_the_shared_steps_still_imports():
    """A user's algorithm file written against rlhf.programs.common keeps importing the
    names the README showed, each the new module's object, with a DeprecationWarning."""
    import importlib

    from rlhf.programs import registry, rollout_sources, steps
    from rlhf.programs.iteration import Iteration

    common = importlib.import_module("rlhf.programs.common")
    for name, want in (("register_algorithm", registry.register_algorithm),
                       ("critic_free", steps.critic_free), ("field_of", steps.field_of),
                       ("Iteration", Iteration), ("Rollout", rollout_sources.IterationRollout)):
        with pytest.warns(DeprecationWarning, match=f"rlhf.programs.common.{name} moved"):
            assert getattr(common, name) is want
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        common.nothing_here
