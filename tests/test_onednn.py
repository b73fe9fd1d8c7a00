"""oneDNN linear layers: the same values and gradients as torch's, and nothing left behind."""

import pytest
import torch
import torch.nn.functional as F
from magrpo_fixtures import tiny_model_path  # noqa: F401 - pytest fixture

from magrpo.speedups import onednn
from magrpo.speedups.onednn import onednn_available, onednn_linears, onednn_supports

pytestmark = pytest.mark.skipif(
    not onednn_available(torch.device("cpu")), reason="this torch build has no oneDNN"
)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
BFLOAT16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not onednn_supports(torch.bfloat16), reason="this CPU has no oneDNN bfloat16 products"
    ),
)


@pytest.fixture(autouse=True)
def _plain_weights_everywhere(monkeypatch):
    """The training pass's oneDNN products are tested on every CPU, also where the BLAS
    library is the faster and the trainer leaves them to it."""
    monkeypatch.setattr(onednn, "_CPU_CAPABILITY", "AVX512")


def _reference_and_onednn(layer, x, grad_output):
    """(outputs, input grad, weight grad, bias grad) of torch's layer, then of the patched one."""
    results = []
    for patched in (False, True):
        x = x.detach().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        if patched:
            with onednn_linears(layer):
                out = layer(x)
        else:
            out = layer(x)
        out.backward(grad_output)
        bias_grad = None if layer.bias is None else layer.bias.grad
        results.append((out.detach(), x.grad, layer.weight.grad, bias_grad))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, BFLOAT16])
@pytest.mark.parametrize("bias", [True, False])
def test_training_linear_matches_torch_forward_and_backward(dtype, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80, bias=bias).to(dtype)
    x = torch.randn(3, 7, 96, dtype=dtype)  # batched like a decoder's activations
    grad_output = torch.randn(3, 7, 80, dtype=dtype)
    expected, got = _reference_and_onednn(layer, x, grad_output)
    for want, have in zip(expected, got, strict=True):
        if want is None:
            assert have is None
            continue
        scale = want.abs().max().item()
        assert (have.float() - want.float()).abs().max().item() <= TOLERANCE[dtype] * scale
    assert "forward" not in vars(layer)  # torch's own forward again after the block


def test_frozen_weights_get_no_gradient():
    layer = torch.nn.Linear(32, 16).requires_grad_(False)
    x = torch.randn(5, 32, requires_grad=True)
    with onednn_linears(layer):
        out = layer(x)
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is None
    assert torch.allclose(x.grad, torch.ones(5, 16) @ layer.weight, atol=1e-5)


def test_packed_weights_serve_inference_and_step_aside_for_gradients():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    x = torch.randn(8, 1, 64)
    with onednn_linears(layer, pack_rows=8):
        with torch.inference_mode():
            packed = layer(x)
        trained = layer(x)  # gradients wanted: torch's own linear, on the live weight
    assert torch.allclose(packed, F.linear(x, layer.weight, layer.bias), atol=1e-5)
    trained.sum().backward()
    assert layer.weight.grad is not None
    assert "forward" not in vars(layer)


def test_mismatched_dtype_falls_back_to_torch():
    layer = torch.nn.Linear(16, 8)  # float32 weights, bfloat16 activations
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with onednn_linears(layer), pytest.raises(RuntimeError):
        layer(x)  # torch's own error for the mismatch, not a oneDNN crash


def test_packed_model_gives_the_same_logits(tiny_model_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
        with onednn_linears(model, pack_rows=1):
            got = model(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-4)
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize(
    "capability, plain", [("AVX512", True), ("AVX2", False), ("DEFAULT", False)]
)
def test_training_pass_leaves_avx2_cpus_to_the_blas_library(monkeypatch, capability, plain):
    monkeypatch.setattr(onednn, "_CPU_CAPABILITY", capability)
    layer = torch.nn.Linear(16, 8)
    with onednn_linears(layer):
        assert ("forward" in vars(layer)) is plain
    with onednn_linears(layer, pack_rows=8):  # decoding packs everywhere: faster on both
        assert "forward" in vars(layer)
