"""Masked token log-probabilities, per-token policy-gradient terms and loss reductions.

A *loss reduction* turns per-token losses of some sequences into one scalar. It receives
the totals of the whole batch of the agent (``LossNormalizer``) so that summing the
reductions of several micro-batches gives exactly the loss of the full batch. Register your
own with ``@register_loss("name")``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossNormalizer:
    """Batch totals of one agent, for reductions that divide by them."""

    num_sequences: int
    num_tokens: int
    max_new_tokens: int


LossFn = Callable[[torch.Tensor, torch.Tensor, LossNormalizer], torch.Tensor]
_LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: ``fn(token_loss [B,T], mask [B,T], normalizer) -> scalar`` as ``name``."""

    def decorate(fn: LossFn) -> LossFn:
        _LOSSES[name] = fn
        return fn

    return decorate


def available_losses() -> list[str]:
    return sorted(_LOSSES)


def get_loss(name: str) -> LossFn:
    try:
        return _LOSSES[name]
    except KeyError:
        raise KeyError(
            f"Unknown loss {name!r}; registered: {', '.join(available_losses())}."
        ) from None


@register_loss("sequence_sum")
def sequence_sum(
    token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer
) -> torch.Tensor:
    """Paper: -(1/G) sum_g A_g sum_t log pi(y_t): token sums, averaged over sequences."""
    return (token_loss * mask).sum() / norm.num_sequences


@register_loss("sequence_mean")
def sequence_mean(
    token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer
) -> torch.Tensor:
    """GRPO: mean over each sequence's tokens, then over sequences."""
    per_sequence = (token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sequence.sum() / norm.num_sequences


@register_loss("token_mean")
def token_mean(token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """DAPO-style: mean over every completion token of the agent's batch."""
    return (token_loss * mask).sum() / max(norm.num_tokens, 1)


@register_loss("dr_grpo")
def dr_grpo(token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """Dr. GRPO: token sum divided by a constant (sequences x max_new_tokens)."""
    return (token_loss * mask).sum() / (norm.num_sequences * norm.max_new_tokens)


def completion_mask(completion_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """1.0 for the first ``lengths[b]`` tokens of row b (the completion up to and including
    its first EOS), 0.0 after (padding). Built from lengths, never from pad ids."""
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return (positions[None, :] < lengths[:, None]).to(torch.float32)


def completion_length(completion_ids: Sequence[int], eos_token_ids: Sequence[int]) -> int:
    """Number of tokens that belong to a completion: up to and including its first EOS."""
    eos = set(eos_token_ids)
    for position, token in enumerate(completion_ids):
        if token in eos:
            return position + 1
    return len(completion_ids)


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per position, in float32 or better (one fused kernel)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    flat = logits.reshape(-1, logits.shape[-1])
    return -F.cross_entropy(flat, target_ids.reshape(-1), reduction="none").view(target_ids.shape)


def policy_token_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    clip_epsilon: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token loss [B, T] for advantages [B]; returns (loss, per-token KL or None).

    Without clipping: -A * log pi (the paper's REINFORCE-style term). With ``clip_epsilon``:
    the PPO clipped surrogate with ratio pi / pi_old. With ``kl_coef`` > 0: plus
    kl_coef * k3(pi, pi_ref), k3 = exp(ref - logp) - (ref - logp) - 1.
    """
    adv = advantages[:, None].to(logprobs.dtype)
    if clip_epsilon is None:
        loss = -adv * logprobs
    else:
        old = logprobs.detach() if old_logprobs is None else old_logprobs
        ratio = torch.exp(logprobs - old)
        clipped = torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon)
        loss = -torch.minimum(ratio * adv, clipped * adv)
    kl = None
    if ref_logprobs is not None and kl_coef > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + kl_coef * kl
    return loss, kl
