"""Lean SwiGLU MLPs: the model's values and gradients, fewer saved tensors."""

import torch
from magrpo_fixtures import tiny_model_path  # noqa: F401 - pytest fixture
from transformers import AutoModelForCausalLM

from magrpo.speedups.swiglu import _SwiGLU, lean_swiglu


def test_swiglu_gradients_match_autograd():
    gate = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (gate, up))


def test_lean_mlp_matches_the_model_and_is_removed_after(tiny_model_path):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    results = []
    for lean in (False, True):
        model.zero_grad(set_to_none=True)
        with lean_swiglu(model) if lean else torch.enable_grad():
            logits = model(input_ids=ids).logits
        logits.square().sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (expected, expected_grads), (got, grads) = results
    assert torch.allclose(got, expected, atol=1e-5)
    for want, have in zip(expected_grads, grads, strict=True):
        assert torch.allclose(have, want, atol=1e-5)
    mlp = model.model.layers[0].mlp
    assert "forward" not in vars(mlp)
    with lean_swiglu(model):
        assert "forward" in vars(mlp)
        out = mlp(torch.randn(2, model.config.hidden_size, requires_grad=True))
    saved = out.grad_fn.next_functions  # down_proj's input is the lean product
    assert any(f is not None and "_SwiGLU" in type(f).__name__ for f, _ in saved)
