"""One gradient buffer for a weight that the input embedding and the output layer share
(tied weights: SmolLM2, Qwen2-0.5B, ...), in full fine-tuning.

Autograd gives each use its own gradient: the output layer's dense [vocab, H] one, and the
embedding's, which torch builds by zero-filling another [vocab, H] tensor and adding the
looked-up rows' gradients into it; the two are then summed. On CPU a fresh tensor of that
size costs its page faults (measured in bfloat16 full fine-tuning of SmolLM2: 112 ms per
model and step for the zero fill alone). Here the output layer hands its weight gradient to
the lookup, whose backward runs after it (the lookup feeds the layers that feed the output
layer); the lookup adds its rows' gradients into it in place and returns the sum as the
weight's gradient. Gradients stay autograd's: ``backward`` and ``torch.autograd.grad`` get
the same values as with two separate uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TiedGradient:
    """Carries the output layer's weight gradient to the embedding lookup's backward."""

    def __init__(self) -> None:
        self.output_layer: torch.Tensor | None = None

    def hand_over(self, grad_weight: torch.Tensor) -> None:
        self.output_layer = (
            grad_weight if self.output_layer is None else self.output_layer + grad_weight
        )

    def take(self) -> torch.Tensor | None:
        grad, self.output_layer = self.output_layer, None
        return grad


def tied_gradient(embedding: torch.nn.Module, head: torch.nn.Module | None) -> TiedGradient | None:
    """A :class:`TiedGradient` when ``head`` and ``embedding`` share a weight that is being
    trained and the embedding is a plain lookup; else None (autograd's own two gradients)."""
    weight = getattr(embedding, "weight", None)
    plain = (
        type(embedding) is torch.nn.Embedding
        and embedding.max_norm is None
        and not embedding.scale_grad_by_freq
        and not embedding.sparse
    )
    trained = weight is not None and weight.requires_grad and torch.is_grad_enabled()
    return TiedGradient() if plain and trained and getattr(head, "weight", None) is weight else None


def tied_lookup(embedding: torch.nn.Embedding, ids: torch.Tensor, tied: TiedGradient):
    """``embedding(ids)``, whose weight gradient includes the output layer's (see module)."""
    return _TiedLookup.apply(ids, embedding.weight, tied, embedding.padding_idx)


class _TiedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, tied, padding_idx):
        ctx.save_for_backward(ids)
        ctx.tied, ctx.padding_idx = tied, padding_idx
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        grad_weight = ctx.tied.take()
        if grad_weight is None:  # the output layer gave none (it had no rows)
            grad_weight = grad.new_zeros(ctx.weight_shape, dtype=ctx.weight_dtype)
        ids, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            kept = ids != ctx.padding_idx
            ids, rows = ids[kept], rows[kept]
        grad_weight.index_add_(0, ids, rows.to(grad_weight.dtype))
        return None, grad_weight, None, None
