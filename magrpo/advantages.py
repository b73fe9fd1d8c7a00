"""Advantage estimators, registered by name.

An estimator maps the returns of one group (the siblings of a tree node, one value per
sample of an agent) to one advantage per sample. Add your own without touching the trainer::

    from magrpo import register_advantage

    @register_advantage("median")
    def median_baseline(returns):
        return returns - returns.median()

and train with ``--advantage median``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]
_ADVANTAGES: dict[str, AdvantageFn] = {}
STD_EPS = 1e-6


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: make ``fn(returns: 1-D tensor) -> advantages`` available as ``name``."""

    def decorate(fn: AdvantageFn) -> AdvantageFn:
        _ADVANTAGES[name] = fn
        return fn

    return decorate


def available_advantages() -> list[str]:
    return sorted(_ADVANTAGES)


def get_advantage(name: str) -> AdvantageFn:
    try:
        return _ADVANTAGES[name]
    except KeyError:
        raise KeyError(
            f"Unknown advantage {name!r}; registered: {', '.join(available_advantages())}."
        ) from None


def compute_advantages(returns: torch.Tensor, name: str, normalize_std: bool) -> torch.Tensor:
    """Advantages of one group; optionally divided by the group's std (+1e-6)."""
    advantages = get_advantage(name)(returns.to(torch.float64))
    if normalize_std and returns.numel() > 1:
        advantages = advantages / (returns.to(torch.float64).std() + STD_EPS)
    return advantages


@register_advantage("magrpo")
def group_mean_baseline(returns: torch.Tensor) -> torch.Tensor:
    """MAGRPO: A_g = R_g - mean(R)."""
    return returns - returns.mean()


@register_advantage("rloo")
def leave_one_out_baseline(returns: torch.Tensor) -> torch.Tensor:
    """MARLOO: A_g = R_g - mean of the other samples' returns."""
    count = returns.numel()
    if count < 2:
        return torch.zeros_like(returns)
    return returns - (returns.sum() - returns) / (count - 1)


@register_advantage("remax")
def max_baseline(returns: torch.Tensor) -> torch.Tensor:
    """MAReMax: A_g = R_g - max(R)."""
    return returns - returns.max()


@register_advantage("reinforce")
def no_baseline(returns: torch.Tensor) -> torch.Tensor:
    """MAREINFORCE: A_g = R_g."""
    return returns.clone()
