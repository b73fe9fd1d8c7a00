"""Numerics over a 49k-token vocabulary that stay on torch's fast vectorised CPU path."""

from __future__ import annotations

import torch

# exp(-80) ~ 1.8e-35: below float32's resolution next to the largest term (exp(0) = 1), so
# clamping there changes no sum, and every exp result stays a normal float.
EXP_FLOOR = -80.0


def shifted_exp_(values: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """exp(values - shift) in place, with arguments below ``EXP_FLOOR`` raised to it.

    On CPU, torch's vectorised exp falls back to a ~30x slower path for arguments whose
    result underflows float32 (measured: 46 ms instead of 1.7 ms for 85 x 49152 logits),
    and most of a vocabulary's shifted logits are that small.
    """
    return values.sub_(shift).clamp_(min=EXP_FLOOR).exp_()


def shifted_exp(values: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """:func:`shifted_exp_` into a new tensor."""
    return (values - shift).clamp_(min=EXP_FLOOR).exp_()


def logsumexp(values: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """log sum exp over the last dimension (kept), the result of ``torch.logsumexp``.

    ``overwrite``: work in ``values`` itself (it is left holding exp(values - max)).
    """
    peak = values.amax(-1, keepdim=True)
    exps = shifted_exp_(values, peak) if overwrite else shifted_exp(values, peak)
    return peak + exps.sum(-1, keepdim=True).log_()
