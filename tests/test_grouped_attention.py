"""Grouped key/value heads kept grouped on CPU: transformers' SDPA values and gradients."""

import json

import torch
from magrpo_fixtures import tiny_model_path  # noqa: F401 - pytest fixture
from transformers import AutoModelForCausalLM

from magrpo.grouped_attention import NAME, use_grouped_attention


def _logits_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits * mask[..., None]).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_grouped_attention_matches_sdpa_on_a_padded_batch(tiny_model_path, tmp_path):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # left padding
    expected, expected_grads = _logits_and_grads(model, ids, mask)
    use_grouped_attention(model)
    assert model.config._attn_implementation == NAME
    got, grads = _logits_and_grads(model, ids, mask)
    assert torch.allclose(got, expected, atol=1e-5)
    for want, have in zip(expected_grads, grads, strict=True):
        assert torch.allclose(have, want, atol=1e-5)
    model.save_pretrained(tmp_path)  # a runtime choice, not part of the saved model
    assert NAME not in (tmp_path / "config.json").read_text()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


def test_other_attention_implementations_are_left_alone(tiny_model_path):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="eager")
    use_grouped_attention(model)
    assert model.config._attn_implementation == "eager"
