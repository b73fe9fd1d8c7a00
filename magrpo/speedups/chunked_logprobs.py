"""The output layer's token log-probs without the [tokens, vocab] logits: chunked, with a
hand-written backward.

Measured by ``benchmarks/update_kernels.py``; tested equal to ``token_logprobs(hidden @
weight.T)`` in ``tests/test_magrpo_policies.py``.
"""

from __future__ import annotations

import torch

from magrpo.numerics import logsumexp, shifted_exp_
from magrpo.speedups.onednn import matmul_t
from magrpo.speedups.tied_weights import TiedGradient

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
