"""The log-prob pass started from the hidden states that sampling already computed.

Sampling runs every decoder layer on each prompt (the prefill) and on each sampled token
(the decode steps), with the weights the update then differentiates. Each layer's input is
therefore known before the update starts, and those inputs are what gradient checkpointing
keeps: with them, the log-prob pass needs no forward of its own. The update runs the top
layer, the norm and the output layer on the top layer's recorded input, and its backward
then goes down the layers one at a time: layer i is run again from its recorded input (the
prompts' part, then the completions' on its keys and values) and differentiated at once,
and the gradient of its input is the gradient of layer i - 1's output. That is one forward
and one backward of the decoder per update, with the activations of one layer at a time:
the memory of checkpointing at the speed of the plain pass.

What the update sees is sampling's sequence split as the decode loop ran it: the prompt
minus its last token (the prefill, once per prompt) and, per completion, the prompt's last
token and the completion's tokens but its last (one decode step each), whose outputs
predict the completion's tokens. The recorded states come from sampling's fused decode
step, which sums in another order than the training forward: the gradients equal the
ordinary pass's up to float rounding (not bit for bit). The states are valid only until the
weights change: the trainer records them for the rollout and drops them after the first
update epoch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from magrpo.rollout import Completion
from magrpo.speedups.interleaved_passes import first_layer_inputs, hidden_states

# layer_pass(index, layer, prompts): the block in which decoder layer ``index`` runs on the
# prompts (True) or on the completions (False)
LayerPass = Callable[[int, torch.nn.Module, bool], AbstractContextManager[Any]]


@dataclass(frozen=True)
class SampledStates:
    """The inputs of every decoder layer for one completion, as sampling computed them."""

    prefix: torch.Tensor  # [layers, prompt length - 1, hidden]: the prompt minus its last token
    steps: torch.Tensor  # [layers, completion length, hidden]: one per decode step


class StateStore:
    """Each sampled completion's :class:`SampledStates`, by the completion object."""

    def __init__(self) -> None:
        self._states: dict[int, tuple[Completion, SampledStates]] = {}

    def add(self, completion: Completion, states: SampledStates) -> None:
        self._states[id(completion)] = (completion, states)

    def find(self, completions: Sequence[Completion]) -> list[SampledStates] | None:
        """The states of all ``completions``, or None if any was not recorded (a copy of a
        completion, e.g. one gathered from another process, was not)."""
        found = []
        for completion in completions:
            entry = self._states.get(id(completion))
            if entry is None or entry[0] is not completion:
                return None
            found.append(entry[1])
        return found


@contextlib.contextmanager
def recorded_layer_inputs(layers: Sequence[torch.nn.Module]) -> Iterator[list[torch.Tensor]]:
    """Within the block, the hidden states each of ``layers`` is called with are appended,
    in call order, to the yielded list (for a prefill: one tensor per layer)."""
    recorded: list[torch.Tensor] = []

    def record(module, args, kwargs):
        recorded.append(args[0] if args else kwargs["hidden_states"])

    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def pad_states(
    states: Sequence[torch.Tensor], width: int, left: bool, like: torch.Tensor
) -> list[torch.Tensor]:
    """Per layer, [rows, width, hidden] from per-row [layers, length, hidden] states, padded
    with zeros on the left (prompts) or the right (completions), as the token batches are."""
    layers, _, hidden = states[0].shape
    padded = [like.new_zeros(len(states), width, hidden) for _ in range(layers)]
    for row, state in enumerate(states):
        length = state.shape[1]
        positions = slice(width - length, width) if left else slice(0, length)
        for layer, layer_state in zip(padded, state, strict=True):
            layer[row, positions] = layer_state
    return padded


class _Run:
    """The layers of one log-prob pass over recorded states: per layer, the prompts' inputs
    [P, Wp, H] and the completions' [B, T, H] (completion b on prompt ``rows[b]``)."""

    def __init__(
        self, network, prompts, completions, prompt_call, completion_call, rows, layer_pass
    ):
        self.network = network
        self.prompts = prompts  # per layer; each dropped once its layer is differentiated
        self.completions = completions
        self.prompt_call = prompt_call  # (args, kwargs, cache key) of a layer's call
        self.completion_call = completion_call
        self.rows = rows
        self.layer_pass = layer_pass

    def forward(self, index: int, prompts: torch.Tensor, completions: torch.Tensor):
        layer = self.network.layers[index]
        cache = DynamicCache(config=self.network.config)
        args, kwargs = _call_with(self.prompt_call, cache)
        with self.layer_pass(index, layer, True):
            prompts = hidden_states(layer(prompts, *args, **kwargs))
        cache.layers[index].reorder_cache(self.rows)  # index_select: differentiable
        args, kwargs = _call_with(self.completion_call, cache)
        with self.layer_pass(index, layer, False):
            completions = hidden_states(layer(completions, *args, **kwargs))
        return prompts, completions

    def backward(self, index: int, grad_prompts: torch.Tensor, grad_completions: torch.Tensor):
        """Layer ``index`` run again from its recorded inputs and differentiated; returns
        the gradients of those inputs (its recorded states are then dropped)."""
        prompts = self.prompts[index].requires_grad_()
        completions = self.completions[index].requires_grad_()
        self.prompts[index] = self.completions[index] = None
        with torch.enable_grad():
            outputs = self.forward(index, prompts, completions)
        torch.autograd.backward(outputs, (grad_prompts, grad_completions))
        return prompts.grad, completions.grad


def _call_with(call: tuple, cache: DynamicCache) -> tuple[tuple, dict]:
    """A layer call's (args, kwargs) with ``cache`` in the cache's place."""
    args, kwargs, key = call
    return args, {**kwargs, key: cache}


class _LayersBelowTop(torch.autograd.Function):
    """Gives the top layer's recorded inputs; its backward runs every layer below the top,
    from the top down, and returns the gradients of the bottom layer's inputs (the
    embeddings, whose values the forward does not need: they are the bottom layer's
    recorded inputs)."""

    @staticmethod
    def forward(
        ctx,
        run: _Run,
        anchor: torch.Tensor,
        prompt_embeds: torch.Tensor,
        completion_embeds: torch.Tensor,
    ):
        ctx.run = run
        return run.prompts.pop(), run.completions.pop()

    @staticmethod
    def backward(ctx, grad_prompts: torch.Tensor, grad_completions: torch.Tensor):
        run, ctx.run = ctx.run, None
        for index in reversed(range(len(run.prompts))):
            grad_prompts, grad_completions = run.backward(index, grad_prompts, grad_completions)
        return None, None, grad_prompts, grad_completions


def final_hidden_from_states(
    network: torch.nn.Module,
    cache_kwarg: str,
    prompts: dict[str, Any],
    completions: dict[str, Any],
    prompt_states: list[torch.Tensor],
    completion_states: list[torch.Tensor],
    rows: torch.Tensor,
    layer_pass: LayerPass,
) -> torch.Tensor:
    """The completions' final (normed) hidden states [B, T, H] of ``network`` (a Llama or
    Qwen2 decoder), computed from the recorded inputs of its layers; the backward goes
    down the layers one at a time and ends in the embeddings ``prompts["inputs_embeds"]``
    and ``completions["inputs_embeds"]`` (forward keyword arguments, as for
    ``interleaved_passes.forwards_in_turn``)."""
    config = network.config
    prompt_call = _layer_call(network, cache_kwarg, prompts, DynamicCache(config=config))
    # the completions' masks are sized from the prompts' cache entry: a stand-in of its shape
    attn = network.layers[0].self_attn
    stand_in = prompt_states[0].new_zeros(
        len(rows), config.num_key_value_heads, prompt_states[0].shape[1], attn.head_dim
    )
    cache = DynamicCache(config=config)
    cache.update(stand_in, stand_in, 0)
    completion_call = _layer_call(network, cache_kwarg, completions, cache)
    run = _Run(
        network, prompt_states, completion_states, prompt_call, completion_call, rows, layer_pass
    )
    # the anchor puts the layers below the top in the graph when the embeddings are frozen
    anchor = torch.empty(0, requires_grad=True)
    top_prompts, top_completions = _LayersBelowTop.apply(
        run, anchor, prompts["inputs_embeds"], completions["inputs_embeds"]
    )
    _, hidden = run.forward(len(network.layers) - 1, top_prompts, top_completions)
    return network.norm(hidden)


def _layer_call(network, cache_kwarg: str, forward_kwargs: dict, cache) -> tuple:
    """(args, kwargs, cache key) with which ``network``'s forward calls a decoder layer."""
    _, args, kwargs = first_layer_inputs(
        network, network.layers[0], **forward_kwargs, **{cache_kwarg: cache}
    )
    keys = [key for key, value in kwargs.items() if value is cache]
    if len(keys) != 1 or any(arg is cache for arg in args):
        raise RuntimeError(f"{type(network).__name__}'s layers do not take the cache by keyword")
    return args, kwargs, keys[0]
