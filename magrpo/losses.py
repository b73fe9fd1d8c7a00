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

from magrpo.numerics import logsumexp, shifted_exp_
from magrpo.speedups.onednn import matmul_t
from magrpo.speedups.tied_weights import TiedGradient


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


LOGIT_CHUNK_ELEMENTS = 1 << 22  # 16 MB of float32 logits per chunk


class _LinearTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[target] without materialising the [N, vocab] logits.

    The output layer (``matmul_t``: oneDNN on CPU) and the log-softmax run over blocks of
    logits, one block alive at a time (lower-precision logits are upcast into one buffer
    reused by every block); backward recomputes each block's logits (one extra
    output-layer matmul) instead of keeping them. With a 49k vocabulary the full logits of
    a micro-batch, their float32 copy and their gradient are hundreds of MB, and on CPU
    every fresh large tensor costs its page faults (measured: a 16 MB temporary took ~20 ms
    to fill in the trainer, 0.6 ms when reused): a block's logits are freed before the next
    block's are made, so the allocator hands the same pages back.

    The forward needs whole rows (each row's log-sum-exp), so its blocks are rows. The
    backward's blocks are vocabulary slices over all rows: each slice's weight gradient is
    then one product written once into its rows of the [vocab, H] gradient, in the weight's
    dtype, instead of a float32 [vocab, H] sum that every row block adds to and that is
    then copied to the weight's dtype (measured in bfloat16 full fine-tuning: ~0.3 s per
    model and step, and 113 MB at the update's peak, for SmolLM2's tied output layer).
    Lower-precision gradients of the logits are rounded to the weight's dtype before both
    products, as a plain lower-precision output layer's backward would have them.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, tied):
        ctx.tied = tied
        ctx.dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32 or better
        chunk = max(1, LOGIT_CHUNK_ELEMENTS // weight.shape[0])
        out = torch.empty(len(hidden), dtype=ctx.dtype, device=hidden.device)
        lse = torch.empty_like(out)
        upcast = _Upcast(ctx.dtype)
        for start in range(0, len(hidden), chunk):
            rows = slice(start, start + chunk)
            logits = upcast(matmul_t(hidden[rows], weight))
            out[rows] = logits.gather(-1, targets[rows, None])[:, 0]
            lse[rows] = logsumexp(logits, overwrite=True)[:, 0]
        ctx.save_for_backward(hidden, weight, targets, lse)
        return out - lse

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_out = grad_out.to(ctx.dtype)
        grad_hidden = torch.zeros_like(hidden, dtype=ctx.dtype) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None  # slices written once
        hidden_low = hidden.to(weight.dtype)
        width = max(1, LOGIT_CHUNK_ELEMENTS // max(1, len(hidden)))
        upcast = _Upcast(ctx.dtype)
        for start in range(0, weight.shape[0], width):
            cols = slice(start, start + width)
            logits = upcast(matmul_t(hidden, weight[cols]))
            # d(logit[target] - logsumexp) / d logits = onehot(target) - softmax
            grad = shifted_exp_(logits, lse[:, None]).mul_(-grad_out[:, None])
            (rows,) = ((targets >= start) & (targets < start + width)).nonzero(as_tuple=True)
            grad.index_put_((rows, targets[rows] - start), grad_out[rows], accumulate=True)
            grad = grad.to(weight.dtype)
            if need_hidden:
                grad_hidden += matmul_t(grad, weight[cols].t())
            if need_weight:
                torch.mm(grad.t(), hidden_low, out=grad_weight[cols])
        if need_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if need_weight and ctx.tied is not None:  # the embedding returns the weight's gradient
            ctx.tied.hand_over(grad_weight)
            grad_weight = None
        return grad_hidden, grad_weight, None, None


class _Upcast:
    """Logit blocks in ``dtype``: lower-precision ones copied into one reused buffer."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.buffer: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype == self.dtype:
            return logits
        if self.buffer is None or self.buffer.numel() < logits.numel():
            self.buffer = torch.empty(logits.numel(), dtype=self.dtype, device=logits.device)
        return self.buffer[: logits.numel()].view(logits.shape).copy_(logits)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    tied: TiedGradient | None = None,
) -> torch.Tensor:
    """``token_logprobs(hidden @ weight.T, target_ids)`` for hidden [N, H], in chunks.

    ``tied``: ``weight`` is also the input embedding's, looked up with the same
    :class:`~magrpo.speedups.tied_weights.TiedGradient` (``tied_lookup``), which then returns the
    weight's whole gradient."""
    return _LinearTokenLogprobs.apply(hidden, weight, target_ids, tied)


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
