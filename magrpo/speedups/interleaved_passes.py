"""The log-prob pass's two forwards run layer by layer in turn, so that its backward
completes the weights' gradients one layer at a time.

The log-prob pass (``Policies.logprobs``) runs the prompts through the decoder, then the
completions on top of the prompts' KV cache: every weight is used twice. Run one after the
other, the prompts' forward has created all its autograd nodes before the completions'
forward creates any. The backward runs the newest ready node first, so it differentiates
the completions' forward through every layer before it starts on the prompts', and each
weight's first gradient waits in autograd's input buffer for its second: all layers'
gradients are alive at once (0.4 GiB for SmolLM2-135M in float32; the in-use heap rose by
0.5 GiB at the start of a backward). That is harmless when the gradients are kept for the
optimizer anyway, but when the optimizer steps inside the backward and frees each gradient
(``optimizer_in_backward``) it is the update's peak.

Run in turn (the prompts' layer i, the completions' layer i, the prompts' layer i + 1...),
the nodes of layer i of both forwards are newer than any of layer i - 1, so the backward
finishes layer i's weights before it starts layer i - 1. The computation is the same:
each layer gets the arguments that transformers' forward gives it (the forward is run up to
its first layer to build them: masks, positions, rotary embeddings), and the completions'
arguments are built once the prompts' first layer has filled the cache entry that their
mask is sized from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from magrpo.speedups.llama_decode import ARCHITECTURES

# layer_pass(index, layer, prompts): the block that pass's forward of decoder layer
# ``index`` runs in (prompts: True for the prompts' pass)
LayerPass = Callable[[int, torch.nn.Module, bool], AbstractContextManager[Any]]


def new_cache(network: torch.nn.Module) -> DynamicCache | None:
    """An empty KV cache for ``network`` if its forwards can run in turn, else None: a
    decoder whose forward is known to be its ``layers``, then ``norm`` (Llama's and
    Qwen2's, as for ``llama_decode``), with every layer a plain full-attention cache entry.
    Sliding-window entries are excluded: the completions' mask is sized from the first
    layer's entry alone."""
    config = getattr(network, "config", None)
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return None
    cache = DynamicCache(config=config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    return cache


def forwards_in_turn(
    network: torch.nn.Module,
    cache: DynamicCache,
    cache_kwarg: str,
    prompts: Mapping[str, Any],
    completions: Mapping[str, Any],
    rows: torch.Tensor,
    layer_pass: LayerPass,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The final (normed) hidden states of ``network``'s forward on ``prompts`` and of its
    forward on ``completions`` (keyword arguments of the forward, with ``use_cache``) on
    top of the prompts' ``cache``, its row ``rows[b]`` under completion b; run layer by
    layer in turn. The cache ends holding both forwards' keys, as the forwards would leave it.
    """
    prompt_hidden, prompt_args, prompt_kwargs = first_layer_inputs(
        network, network.layers[0], **prompts, **{cache_kwarg: cache}
    )
    for index, layer in enumerate(network.layers):
        with layer_pass(index, layer, True):
            prompt_hidden = hidden_states(layer(prompt_hidden, *prompt_args, **prompt_kwargs))
        cache.layers[index].reorder_cache(rows)  # index_select: differentiable
        if index == 0:
            hidden, args, kwargs = first_layer_inputs(
                network, layer, **completions, **{cache_kwarg: cache}
            )
        with layer_pass(index, layer, False):
            hidden = hidden_states(layer(hidden, *args, **kwargs))
    return network.norm(prompt_hidden), network.norm(hidden)


class _FirstLayerReached(Exception):
    def __init__(self, args: tuple, kwargs: dict):
        super().__init__()
        self.args_, self.kwargs = args, kwargs


def first_layer_inputs(
    network: torch.nn.Module, first_layer: torch.nn.Module, **forward_kwargs
) -> tuple[torch.Tensor, tuple, dict]:
    """The hidden states and the other positional and keyword arguments with which
    ``network``'s forward calls its first decoder layer; the forward stops there."""

    def stop(module, args, kwargs):
        raise _FirstLayerReached(args, kwargs)

    handle = first_layer.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        network(**forward_kwargs)
    except _FirstLayerReached as reached:
        args, kwargs = reached.args_, dict(reached.kwargs)
        if args:
            return args[0], args[1:], kwargs
        return kwargs.pop("hidden_states"), (), kwargs
    finally:
        handle.remove()
    raise RuntimeError(f"{type(network).__name__}'s forward did not call its first decoder layer")


def hidden_states(output) -> torch.Tensor:
    """A decoder layer's hidden states (some models' layers return a tuple)."""
    return output[0] if isinstance(output, tuple) else output
