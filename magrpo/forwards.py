"""The transformers forwards that sampling and the log-prob pass run: a cached pass that
keeps only the last position, and a decode step on a static KV cache."""

from __future__ import annotations

import torch
from transformers import StaticCache


def output_cache(output):
    """The KV cache of a forward output (``cache`` in transformers >= 5.2x, else the old name)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def last_position_pass(network, head, inputs, attention_mask, positions=None, **cache):
    """A cached forward of which only the last position's output is used: left-padded
    prompts, or one decode step (``inputs``: token ids [B, L], or their embeddings
    [B, L, H]). When the network is the whole model (``head`` None), only that position's
    logits are computed."""
    return network(
        **{"input_ids" if inputs.dim() == 2 else "inputs_embeds": inputs},
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask) if positions is None else positions,
        use_cache=True,
        **({"logits_to_keep": 1} if head is None else {}),
        **cache,
    )


def static_cache_forward(loaded, network, head, mask, prefix, num_samples):
    """transformers' forward of a decode step, on a static cache that starts with G copies
    of the prefill (if any): ``forward(ids, positions)`` -> the last position's logits.
    ``head`` None: ``network`` is the whole model."""
    cache = StaticCache(config=loaded.model.config, max_cache_len=mask.shape[1])
    cached = 0
    if prefix is not None:
        for static, prefilled in zip(cache.layers, prefix.layers, strict=True):
            static.update(
                prefilled.keys.repeat_interleave(num_samples, dim=0),
                prefilled.values.repeat_interleave(num_samples, dim=0),
            )
        cached = prefix.get_seq_length()

    def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        nonlocal cached
        cached += ids.shape[1]
        output = last_position_pass(
            network, head, ids, mask[:, :cached], positions, **{loaded.cache_kwarg: cache}
        )
        if head is None:
            return output.logits[:, -1]
        return head(output.last_hidden_state[:, -1])

    return forward
