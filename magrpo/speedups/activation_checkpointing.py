"""Activation checkpointing for the log-prob pass, which runs on a KV cache.

With checkpointing, a decoder layer keeps only its input for backward and runs again when
the backward reaches it: the activations of a pass shrink from every layer's to about one
layer's, for one more forward of the decoder per update.

transformers' own gradient checkpointing turns the KV cache off, but the log-prob pass
(``Policies.logprobs``) needs it: the prompts' pass writes the cache that the completions'
pass attends to and extends, so a replayed layer would find its own keys already appended.
Here a layer's replay first puts its cache entry back as it was before the layer ran, so the
replay sees exactly what the forward saw. The replay also runs inside the same patched
forwards (oneDNN linears, lean SwiGLU, LoRA routing) as the forward: those blocks have ended
when the backward runs, so ``replay_context(layer)`` enters them again, for that layer's
modules only (for the whole model, a replay's patching would cost as much as its products:
~2 s per LoRA update on SmolLM2).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from magrpo.speedups.module_patching import forwards_replaced, is_patched


class CheckpointingUnsupported(ValueError):
    pass


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The list of ``model``'s decoder layers (transformers' ``GradientCheckpointingLayer``s;
    layer i writes entry i of the KV cache)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) > 0
            and all(isinstance(layer, GradientCheckpointingLayer) for layer in module)
        ):
            return module
    raise CheckpointingUnsupported(
        f"gradient checkpointing needs a transformers model whose decoder layers are "
        f"GradientCheckpointingLayer modules; {type(model).__name__} has none. Turn "
        "gradient_checkpointing off for this model."
    )


@contextlib.contextmanager
def checkpointed_layers(
    layers: Mapping[int, torch.nn.Module],
    replay_context: Callable[[torch.nn.Module], AbstractContextManager[Any]],
) -> Iterator[None]:
    """Within the block, every forward with gradients through ``layers`` (decoder layers by
    their index, e.g. ``dict(enumerate(decoder_layers(model)))``) is checkpointed layer by
    layer. ``replay_context(layer)``: the blocks the forward runs in (patched forwards,
    routing), entered again for ``layer`` around its replay."""
    forwards = {
        layer: functools.partial(_checkpointed, index, layer, layer.forward, replay_context)
        for index, layer in layers.items()
        if not is_patched(layer)
    }
    with forwards_replaced(forwards):
        yield


def _checkpointed(index, layer, forward, replay_context, hidden_states, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(hidden_states, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    before = _cache_entry(cache, index)
    replay = False

    def run(hidden: torch.Tensor):
        nonlocal replay
        with replay_context(layer) if replay else contextlib.nullcontext():
            replay = True
            _restore_cache_entry(cache, index, before)
            return forward(hidden, *args, **kwargs)

    return checkpoint(run, hidden_states, use_reentrant=False)


def _cache_entry(cache, index: int) -> dict[str, Any] | None:
    """A shallow copy of cache layer ``index``'s state (None: no cache, or no entry yet)."""
    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers):
        return None
    return dict(vars(layers[index]))


def _restore_cache_entry(cache, index: int, state: dict[str, Any] | None) -> None:
    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers):
        return
    if state is None:  # the forward created this entry: start again from a fresh one
        make = getattr(cache, "layer_class_to_replicate", None) or type(layers[index])
        layers[index] = make()
        return
    entry = vars(layers[index])
    entry.clear()
    entry.update(state)
