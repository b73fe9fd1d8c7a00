"""Activation checkpointing of the log-prob pass: the same log-probs and gradients as without
it (the prompts' KV cache, routed adapters and patched forwards replayed), with a fraction of
the saved activations."""

import pytest
import torch
from magrpo_fixtures import (  # noqa: F401 - pytest fixture
    completions_of_two_prompts,
    policies_to_compare,
    tiny_model_path_per_architecture,
)

from magrpo.loading import load_policies
from magrpo.speedups.activation_checkpointing import CheckpointingUnsupported, decoder_layers


@pytest.fixture
def tiny_model_path(tiny_model_path_per_architecture):  # noqa: F811
    return tiny_model_path_per_architecture


def _pass(policies, completions, checkpointing: bool):
    """Log-probs, gradients and the bytes autograd saved for backward, in one pass."""
    policies.speedups.gradient_checkpointing = checkpointing
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        batch = policies.logprobs(completions)
    params = {
        n: p for b in policies.models for n, p in b.model.named_parameters() if p.requires_grad
    }
    for param in params.values():
        param.grad = None
    (batch.logprobs * torch.linspace(0.5, 1.5, batch.logprobs.shape[1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    return batch.logprobs.detach(), grads, sum(saved)


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_checkpointed_pass_equals_the_plain_one(tiny_model_path, finetune):
    policies, agents = policies_to_compare(tiny_model_path, finetune)
    completions = completions_of_two_prompts(policies, agents)
    logprobs, grads, saved = _pass(policies, completions, checkpointing=False)
    checkpointed, checkpointed_grads, checkpointed_saved = _pass(policies, completions, True)
    torch.testing.assert_close(checkpointed, logprobs, rtol=0, atol=0)
    assert grads.keys() == checkpointed_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-6)
    # only the layers' inputs (and what is outside them) stay alive until the backward
    assert checkpointed_saved < saved / 2


def test_reference_pass_without_gradients_is_not_checkpointed(tiny_model_path):
    policies = load_policies(["alice", "bob"], [tiny_model_path] * 2)
    policies.speedups.gradient_checkpointing = True
    completions = completions_of_two_prompts(policies, ["alice", "bob"])
    reference = policies.logprobs(completions, reference=True)
    assert reference.logprobs.grad_fn is None
    policies.speedups.gradient_checkpointing = False
    torch.testing.assert_close(
        policies.logprobs(completions, reference=True).logprobs, reference.logprobs
    )


def test_models_without_decoder_layers_are_refused():
    with pytest.raises(CheckpointingUnsupported, match="GradientCheckpointingLayer"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_cache_entry_made_by_the_forward_is_made_afresh_for_the_replay():
    """A cache built without a config grows its layers lazily: the replay of the layer that
    created entry 0 must not find it holding the forward's keys."""
    from transformers import DynamicCache

    from magrpo.speedups.activation_checkpointing import _cache_entry, _restore_cache_entry

    cache = DynamicCache()
    before = _cache_entry(cache, 0)
    assert before is None
    keys = torch.ones(1, 2, 3, 4)
    cache.update(keys, keys, 0)
    _restore_cache_entry(cache, 0, before)
    replayed, _ = cache.update(keys, keys, 0)
    assert replayed.shape == keys.shape  # not appended to the forward's
