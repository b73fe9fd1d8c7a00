"""transformers' SDPA attention on CPU: grouped key/value heads kept grouped, and a faster
half-precision training pass.

With an attention mask (we always pass one: prompts are left-padded), transformers' "sdpa"
attention repeats every key/value head for the query heads that share it (``repeat_kv``)
before calling ``scaled_dot_product_attention``, because CUDA's efficient kernels cannot
take grouped heads with a mask. torch's CPU flash kernel can (``enable_gqa``). On SmolLM2
(9 query heads, 3 key/value heads) the repeat triples the keys and values that the
training pass keeps for backward, including the prompt's cached ones gathered for every
completion: measured 0.12-0.15 GB of a LoRA step's peak at G = 4, and the kernel is faster
on the smaller tensors.

In bfloat16 (and float16) with gradients, the CPU flash kernel's backward is slow: 4.3-8.0
ms per SmolLM2 layer call, where the batched products below, probabilities recomputed, take
1.7-4.8 ms (the training pass's shapes, 2 threads; ``benchmarks/profile_step.py``). There
:class:`MatmulAttention` computes attention as transformers' eager attention does (scores
in the input's precision), with all of a key/value head's query heads in one product, and
recomputes the probabilities in backward instead of keeping them, so it saves what the
flash kernel saves. It is used while the
score tensor stays small (``MATMUL_SCORES``); long sequences keep the flash kernel, which
never holds all scores at once.

Everything else (GPU, single-token decode steps, softcapping, position biases, models
without grouped heads outside the half-precision training pass) goes to transformers' own
function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "sdpa_grouped_cpu"
# Largest score tensor (batch x heads x queries x keys) computed whole: 16M elements is
# 32 MiB in bfloat16, for one layer at a time (SmolLM2's training pass at G = 4: 0.3-0.6M).
MATMUL_SCORES = 1 << 24


class MatmulAttention(torch.autograd.Function):
    """``softmax(q k^T * scale, masked) v`` with grouped heads: ``query`` [B, H, L, D],
    ``key``/``value`` [B, H_kv, S, D], ``keep`` a boolean mask broadcastable to
    [B, 1, L, S] (True: attend). Saves the inputs and the output, not the probabilities."""

    @staticmethod
    def forward(ctx, query, key, value, keep, scale):
        probs = _probabilities(query, key, keep, scale)
        output = torch.matmul(probs, value)
        ctx.save_for_backward(query, key, value, keep, output)
        ctx.scale = scale
        return output.view(query.shape)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, keep, output = ctx.saved_tensors
        probs = _probabilities(query, key, keep, ctx.scale)
        grad_output = grad_output.reshape(output.shape)
        grad_value = torch.matmul(probs.transpose(-1, -2), grad_output)
        grad_probs = torch.matmul(grad_output, value.transpose(-1, -2))
        # the softmax's own backward (what autograd runs for torch.softmax); masked scores
        # are constants, so no gradient reaches them (rows that see no key have uniform
        # probabilities, whose gradients would not vanish by themselves)
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        _mask_scores(grad_scores, query, keep, 0.0).mul_(ctx.scale)
        grad_query = torch.matmul(grad_scores, key).view(query.shape)
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), _grouped(query, key))
        return grad_query, grad_key, grad_value, None, None


def _grouped(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> [B, H_kv, H / H_kv * L, D]: the query heads that share a key/value
    head, one after the other, so that one product per key/value head serves them all."""
    batch, heads, length, dim = query.shape
    return query.reshape(batch, key.shape[1], heads // key.shape[1] * length, dim)


def _probabilities(query, key, keep, scale) -> torch.Tensor:
    """Attention probabilities [B, H_kv, H / H_kv * L, S]; fully masked rows are uniform (as
    in transformers' eager attention), not NaN."""
    scores = torch.matmul(_grouped(query, key), key.transpose(-1, -2)).mul_(scale)
    _mask_scores(scores, query, keep, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1)


def _mask_scores(scores, query, keep, value) -> torch.Tensor:
    """Fill the grouped scores [B, H_kv, H / H_kv * L, S] where ``keep`` is False, in place."""
    batch, heads, length, _ = query.shape
    grouped = scores.view(batch, scores.shape[1], heads // scores.shape[1], length, -1)
    grouped.masked_fill_(~keep.unsqueeze(2), value)
    return scores


def _matmul_mask(module, query, key, attention_mask, dropout, is_causal) -> torch.Tensor | None:
    """The boolean mask for :class:`MatmulAttention`, or None where it does not apply."""
    batch, heads, length, _ = query.shape
    if (
        query.dtype not in (torch.bfloat16, torch.float16)
        or not torch.is_grad_enabled()
        or dropout
        or heads % key.shape[1]
        or batch * heads * length * key.shape[2] > MATMUL_SCORES
    ):
        return None
    if attention_mask is not None:
        fits = attention_mask.dtype == torch.bool and attention_mask.dim() == 4
        return attention_mask if fits and attention_mask.shape[1] == 1 else None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    keep = torch.ones(length, key.shape[2], dtype=torch.bool, device=query.device)
    return (keep.tril(key.shape[2] - length) if causal else keep)[None, None]


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ours = (
        query.device.type == "cpu"
        and query.shape[2] > 1
        and not any(kwargs.get(k) for k in ("softcap", "position_bias", "output_attentions"))
    )
    keep = _matmul_mask(module, query, key, attention_mask, dropout, is_causal) if ours else None
    if keep is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        output = MatmulAttention.apply(query, key, value, keep, scale)
    elif ours and attention_mask is not None and getattr(module, "num_key_value_groups", 1) > 1:
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            enable_gqa=True,
        )  # fmt: skip
    else:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    return output.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: torch.nn.Module) -> None:
    """Switch a CPU model that uses transformers' "sdpa" attention to this one."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    parameter = next(model.parameters(), None)
    if (
        config is None
        or getattr(config, "_attn_implementation", None) != "sdpa"
        or parameter is None
        or parameter.device.type != "cpu"
        or not hasattr(model, "set_attn_implementation")
    ):
        return
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
