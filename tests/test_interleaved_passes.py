"""The log-prob pass's two forwards run layer by layer in turn: the same log-probs and
gradients as run one after the other, and each layer's weight gradients complete before
the backward goes below that layer."""

import functools

import pytest
import torch
from magrpo_fixtures import (  # noqa: F401 - pytest fixture
    completions_of_two_prompts,
    policies_to_compare,
    tiny_model_path_per_architecture,
)

from magrpo.loading import load_policies
from magrpo.speedups.activation_checkpointing import decoder_layers
from magrpo.speedups.interleaved_passes import new_cache


@pytest.fixture
def tiny_model_path(tiny_model_path_per_architecture):  # noqa: F811
    return tiny_model_path_per_architecture


def _backward(batch):
    (batch.logprobs * torch.linspace(0.5, 1.5, batch.logprobs.shape[1])).sum().backward()


def _pass(policies, completions, in_turn: bool):
    """Log-probs and gradients of one pass."""
    policies.speedups.passes_in_turn = in_turn
    params = {
        n: p for b in policies.models for n, p in b.model.named_parameters() if p.requires_grad
    }
    for param in params.values():
        param.grad = None
    batch = policies.logprobs(completions)
    _backward(batch)
    return batch.logprobs.detach(), {n: p.grad.clone() for n, p in params.items()}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_passes_in_turn_compute_what_the_passes_one_after_the_other_do(
    tiny_model_path, finetune, checkpointing
):
    policies, agents = policies_to_compare(tiny_model_path, finetune)
    policies.speedups.gradient_checkpointing = checkpointing
    completions = completions_of_two_prompts(policies, agents)
    logprobs, grads = _pass(policies, completions, in_turn=False)
    in_turn, in_turn_grads = _pass(policies, completions, in_turn=True)
    torch.testing.assert_close(in_turn, logprobs, rtol=0, atol=0)
    assert grads.keys() == in_turn_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(in_turn_grads[name], grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("in_turn", [False, True])
def test_each_layer_s_weights_complete_before_the_backward_leaves_the_layer(
    tiny_model_path, in_turn
):
    """Run one after the other, each weight's first gradient waits for the prompts' pass,
    which the backward reaches only after the completions' pass: the backward leaves the top
    layer before any weight there is complete (on SmolLM2 it went through all 30 layers).
    Run in turn, every layer's weights are complete before the completions' gradient leaves
    the layer."""
    policies = load_policies(["alice"], [tiny_model_path], finetune="full")
    policies.speedups.passes_in_turn = in_turn
    layers = decoder_layers(policies.models[0].model)
    completions = completions_of_two_prompts(policies, ["alice"])
    events = []

    def watch_input(index, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.requires_grad and len(hidden) == len(completions):  # the completions' pass
            hidden.register_hook(lambda grad: events.append(("left", index)))

    def completed(index, param):
        events.append(("weight", index))

    handles = []
    for index, layer in enumerate(layers):
        handles.append(
            layer.register_forward_pre_hook(functools.partial(watch_input, index), with_kwargs=True)
        )
        handles += [
            p.register_post_accumulate_grad_hook(functools.partial(completed, index))
            for p in layer.parameters()
        ]
    try:
        _backward(policies.logprobs(completions))
    finally:
        for handle in handles:
            handle.remove()
    in_order = []
    for index in range(len(layers)):
        last_weight = max(k for k, event in enumerate(events) if event == ("weight", index))
        in_order.append(last_weight < events.index(("left", index)))
    assert all(in_order) if in_turn else not in_order[-1], events


def test_other_decoders_run_the_passes_one_after_the_other(tiny_model_path):
    """Only a forward known to be the layers then the final norm runs in turn, and only on
    full-attention caches: the completions' mask is sized from the first layer's entry."""
    policies = load_policies(["alice"], [tiny_model_path], finetune="full")
    network, _ = policies.speedups.split(policies.models[0], policies.models[0].model)
    assert new_cache(network) is not None
    architecture, network.config.model_type = network.config.model_type, "gemma"
    assert new_cache(network) is None
    network.config.model_type = architecture
    network.config.layer_types = ["sliding_attention"] * network.config.num_hidden_layers
    network.config.sliding_window = 4
    assert new_cache(network) is None
