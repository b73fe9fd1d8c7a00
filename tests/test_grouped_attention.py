"""Grouped key/value heads kept grouped on CPU: transformers' SDPA values and gradients."""

import json

import torch
import torch.nn.functional as F
from magrpo_fixtures import tiny_model_path  # noqa: F401 - pytest fixture
from transformers import AutoModelForCausalLM

from magrpo.speedups.grouped_attention import NAME, MatmulAttention, use_grouped_attention


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


def _attention_inputs(dtype, batch=2, heads=6, kv_heads=2, length=5, keys=8):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, length, 4, generator=generator, dtype=dtype)
    key = torch.randn(batch, kv_heads, keys, 4, generator=generator, dtype=dtype)
    value = torch.randn(batch, kv_heads, keys, 4, generator=generator, dtype=dtype)
    keep = torch.ones(batch, 1, length, keys, dtype=torch.bool).tril(keys - length)
    keep[0, :, :, :4] = False  # left padding of row 0: its first query sees no key at all
    return [t.requires_grad_() for t in (query, key, value)], keep


def test_matmul_attention_gradients_are_exact():
    """The hand-written backward against numerical derivatives (float64)."""
    (query, key, value), keep = _attention_inputs(torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: MatmulAttention.apply(q, k, v, keep, 0.5), (query, key, value)
    )


def test_matmul_attention_matches_sdpa_where_a_query_sees_keys():
    (query, key, value), keep = _attention_inputs(torch.float64)
    got = MatmulAttention.apply(query, key, value, keep, 0.5)
    want = F.scaled_dot_product_attention(
        query, key, value, attn_mask=keep, scale=0.5, enable_gqa=True
    )
    sees = keep.any(-1, keepdim=True).expand_as(got)  # SDPA leaves fully masked rows undefined
    assert torch.allclose(got[sees], want[sees])
    assert torch.isfinite(got).all()


def test_bfloat16_training_pass_uses_matmul_attention(tiny_model_path, monkeypatch):  # noqa: F811
    """A padded bfloat16 batch with gradients takes the matmul attention, whose logits and
    gradients stay as close to the float32 model's as transformers' own SDPA's do."""
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    exact = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa")
    want, want_grads = _logits_and_grads(exact, ids, mask)

    def errors(model):
        logits, grads = _logits_and_grads(model, ids, mask)
        real = mask.bool()
        pairs = [(logits[real], want[real]), *zip(grads, want_grads, strict=True)]
        return [float((a.float() - b).abs().max() / b.abs().max()) for a, b in pairs]

    def bfloat16_model():
        return AutoModelForCausalLM.from_pretrained(
            tiny_model_path, attn_implementation="sdpa", dtype=torch.bfloat16
        )

    sdpa_errors = errors(bfloat16_model())
    calls = []
    apply = MatmulAttention.apply
    monkeypatch.setattr(MatmulAttention, "apply", lambda *a: calls.append(1) or apply(*a))
    model = bfloat16_model()
    use_grouped_attention(model)
    ours = errors(model)
    assert len(calls) == model.config.num_hidden_layers
    for have, bound in zip(ours, sdpa_errors, strict=True):
        assert have <= max(2 * bound, 1e-2)
