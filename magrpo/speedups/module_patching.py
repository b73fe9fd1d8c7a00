"""Swap some modules' forward for the length of a block, and put torch's back after."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def forwards_replaced(
    forwards: dict[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]],
) -> Iterator[None]:
    """Within the block, ``module(x)`` calls ``forwards[module](x)`` (an instance attribute
    shadowing the class's ``forward``; deleting it restores the original, even on error)."""
    for module, forward in forwards.items():
        module.forward = forward
    try:
        yield
    finally:
        for module in forwards:
            del module.forward


def is_patched(module: torch.nn.Module) -> bool:
    """Whether something (another block, peft, a router) already replaced the forward."""
    return "forward" in vars(module)
