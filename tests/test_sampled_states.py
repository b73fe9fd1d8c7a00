"""The log-prob pass started from the layer inputs that sampling recorded: the same
log-probs and gradients as the ordinary pass (up to float rounding), and the ordinary pass
wherever nothing was recorded."""

import logging

import pytest
import torch
from magrpo_fixtures import (  # noqa: F401 - pytest fixture
    completions_of_two_prompts,
    policies_to_compare,
    tiny_model_path_per_architecture,
)

from magrpo.loading import load_policies
from magrpo.policies import SamplingParams
from magrpo.speedups.sampled_states import StateStore


@pytest.fixture
def tiny_model_path(tiny_model_path_per_architecture):  # noqa: F811
    return tiny_model_path_per_architecture


def _trainable(policies):
    return {
        name: param
        for b in policies.models
        for name, param in b.model.named_parameters()
        if param.requires_grad
    }


def _pass(policies, completions):
    """Log-probs and gradients of one log-prob pass and backward."""
    params = _trainable(policies)
    for param in params.values():
        param.grad = None
    batch = policies.logprobs(completions)
    (batch.logprobs * torch.linspace(0.5, 1.5, batch.logprobs.shape[1])).sum().backward()
    return batch.logprobs.detach(), {n: p.grad.clone() for n, p in params.items()}


def _sampled(policies, agents):
    """Two prompts of different lengths, four samples each, recorded: near-uniform draws
    over the small vocabulary, seeded until some end early (EOS), so that the completions'
    lengths differ."""
    requests = [(agents[0], "say words"), (agents[-1], "a task with more words")]
    params = SamplingParams(max_new_tokens=10, temperature=100.0)
    for seed in range(0, 40, 2):
        policies.speedups.sampled_states = StateStore()
        groups = policies.sample(requests, 4, params, seeds=[seed, seed + 1])
        completions = [c for group in groups for c in group]
        if len({len(c.completion_ids) for c in completions}) > 1:
            return completions
    raise AssertionError("no seed gave completions of different lengths")


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_the_pass_from_sampled_states_computes_what_the_ordinary_pass_does(
    tiny_model_path, finetune
):
    policies, agents = policies_to_compare(tiny_model_path, finetune)
    completions = _sampled(policies, agents)
    store = policies.speedups.sampled_states
    assert store.find(completions) is not None
    from_states, grads_from_states = _pass(policies, completions)
    policies.speedups.sampled_states = None
    ordinary, grads = _pass(policies, completions)
    torch.testing.assert_close(from_states, ordinary, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_from_states.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grads_from_states[name], grad, rtol=1e-4, atol=1e-5)


def test_the_backward_finishes_each_layer_before_running_the_one_below(tiny_model_path):
    """Layer i runs again (from its recorded inputs) only once every weight of layer i + 1
    has its gradient: one layer's activations at a time, each layer's gradients complete
    (and, with the optimizer in backward, stepped and freed) before the next starts."""
    policies = load_policies(["alice"], [tiny_model_path], finetune="full")
    completions = _sampled(policies, ["alice"])
    layers = policies.models[0].model.model.layers
    batch = policies.logprobs(completions)
    events = []
    handles = [
        layer.register_forward_pre_hook(lambda module, args, i=i: events.append(("run", i)))
        for i, layer in enumerate(layers)
    ]
    for i, layer in enumerate(layers):
        for param in layer.parameters():
            handles.append(
                param.register_post_accumulate_grad_hook(lambda p, i=i: events.append(("done", i)))
            )
    batch.logprobs.sum().backward()
    for handle in handles:
        handle.remove()
    # the top layer ran in the forward; every layer below runs in the backward, top down
    assert [i for kind, i in events if kind == "run"] == [
        i
        for i in reversed(range(len(layers) - 1))
        for _ in range(2)  # prompts, completions
    ]
    for below in range(len(layers) - 1):
        first_run = events.index(("run", below))
        done_above = [n for n, event in enumerate(events) if event == ("done", below + 1)]
        assert len(done_above) == len(list(layers[below + 1].parameters()))
        assert max(done_above) < first_run


def test_completions_without_recorded_states_take_the_ordinary_pass(tiny_model_path, caplog):
    policies = load_policies(["alice"], [tiny_model_path], finetune="full")
    completions = completions_of_two_prompts(policies, ["alice"])  # not sampled: no states
    expected = policies.logprobs(completions).logprobs.detach()
    policies.speedups.sampled_states = StateStore()
    with caplog.at_level(logging.WARNING, logger="magrpo.policies"):
        got = policies.logprobs(completions).logprobs.detach()
        policies.logprobs(completions)
    assert torch.equal(got, expected)
    assert caplog.text.count("runs the ordinary log-prob pass") == 1  # warned once per model
