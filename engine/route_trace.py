"""The experts each token of a forward is routed to, layer after layer: recorded (the
generation engine's routes) and, for router replay in training, imposed.  Shared by the
training model and generation; the layers see it as a :class:`engine.moe.RouteRecord`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RouteTrace:
    """The experts the mixture-of-experts layers of one forward route each token to, in layer
    order: recorded (:attr:`chosen`) and, for router replay, imposed (:attr:`replay`).

    With ``replay [N, L, k]`` the ``j``-th MoE layer of the forward sends token ``n`` to the
    experts ``replay[n, j]`` (a negative entry: the router's own top k for that token) with
    weights the router's current probabilities of those experts (renormalised where the
    routing does): the experts of the rollout, the probabilities of the policy being trained.
    """

    replay: torch.Tensor | None = None
    chosen: list[torch.Tensor] = field(default_factory=list)

    def replayed(self, device: torch.device) -> torch.Tensor | None:
        """The next layer's ``[N, k]`` imposed experts on ``device`` (None without replay)."""
        if self.replay is None:
            return None
        return self.replay[:, len(self.chosen)].to(device, torch.int64)

    def record(self, experts: torch.Tensor) -> None:
        """The next layer's ``[N, k]`` experts, as routed."""
        self.chosen.append(experts)

    def recorded(self) -> torch.Tensor:
        """``[N, L, k]`` of every layer so far."""
        return torch.stack(self.chosen, dim=1)
