"""The decode steps' AVX2 kernel (magrpo/speedups/blocked_matmul.py) against torch's products."""

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

from magrpo.speedups import blocked_matmul, onednn
from magrpo.speedups.blocked_matmul import BLOCK, BlockedMatmul, blockable, blocked_matmul_pays

pytestmark = pytest.mark.skipif(
    blocked_matmul.library() is None, reason="the kernel cannot be built here (see the log)"
)

K = 40  # not a multiple of the 8 floats of an AVX register


def _weights(*widths, k=K):
    return [torch.randn(n, k) for n in widths]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 33])
def test_products_equal_torch_with_bias_and_residual(rows):
    torch.manual_seed(rows)
    weights = _weights(16, 48, 32)
    bias = torch.randn(96)
    x = torch.randn(rows, K + 7)[:, 3 : 3 + K]  # rows with a stride of their own
    residual = torch.randn(rows, 96)
    expected = F.linear(x, torch.cat(weights), bias) + residual
    product = BlockedMatmul(weights, bias)
    torch.testing.assert_close(product(x, residual), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(product(x), F.linear(x, torch.cat(weights), bias))
    assert torch.equal(product(x), product(x))  # no state carried between calls
    no_bias = BlockedMatmul(weights[:1])
    torch.testing.assert_close(no_bias(x), x @ weights[0].t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_class", ["llama", "qwen2"])
@pytest.mark.parametrize("features", [K, 576])
def test_rms_norm_equals_transformers(norm_class, features):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(features)
    norm = {"llama": LlamaRMSNorm, "qwen2": Qwen2RMSNorm}[norm_class](features, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, features + 3)[:, 2 : 2 + features] * 3  # strided rows
    with torch.no_grad():
        expected = norm(x)
    got = blocked_matmul.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        blocked_matmul.rms_norm(x.double(), norm.weight.detach(), 1e-5)


@pytest.mark.parametrize("half", [K + 3, 1536])  # a tail past the last register; SmolLM2
def test_silu_mul_equals_the_models_activation(half):
    from transformers.activations import ACT2FN

    torch.manual_seed(half)
    hidden = torch.randn(5, 2 * half + 4)[:, 1 : 1 + 2 * half] * 4  # strided rows
    hidden[0, :8] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 1e-30, -90.0, 88.0, float("nan")])
    expected = ACT2FN["silu"](hidden[:, :half]) * hidden[:, half:]
    got = blocked_matmul.silu_mul(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, equal_nan=True)
    for bad in (hidden.double(), hidden[:, 1:], hidden[0]):
        with pytest.raises(ValueError):
            blocked_matmul.silu_mul(bad)


def test_inputs_of_the_wrong_shape_are_refused():
    """The kernel checks no bounds: every shape is checked before it runs."""
    product = BlockedMatmul(_weights(16, 32))
    with pytest.raises(ValueError, match="rows"):
        product(torch.randn(2, K + 1))
    with pytest.raises(ValueError, match="rows"):
        product(torch.randn(2, K, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows"):
        product(torch.randn(2, K), residual=torch.randn(2, 16))
    with pytest.raises(ValueError, match="residual rows"):
        product(torch.randn(2, K), residual=torch.randn(3, 48))


def test_weights_blocked_in_place_come_back_exactly():
    weights = _weights(32, 16, k=24)
    originals = [w.clone() for w in weights]
    pointers = [w.data_ptr() for w in weights]
    x = torch.randn(3, 24)
    product = BlockedMatmul(weights, in_place=[True, False])
    # the first is its own memory, permuted block by block; the second was copied
    assert [w.data_ptr() for w in weights] == pointers
    blocked = originals[0].view(-1, BLOCK, 24).transpose(1, 2).reshape(32, 24)
    assert torch.equal(weights[0], blocked)
    assert torch.equal(weights[1], originals[1])
    torch.testing.assert_close(product(x), x @ torch.cat(originals).t(), rtol=1e-5, atol=1e-5)
    product.restore_weights()
    assert all(torch.equal(w, o) for w, o in zip(weights, originals, strict=True))
    with pytest.raises(RuntimeError, match="after restore_weights"):
        product(x)


def test_kernel_runs_on_torchs_threads():
    """torch.set_num_threads (per thread, as side-by-side sampling sets it) reaches the
    kernel: one OpenMP runtime, not two competing for the cores."""
    kernel = blocked_matmul.library()
    assert kernel.max_threads() == torch.get_num_threads()
    seen = []

    def worker():
        torch.set_num_threads(1)
        seen.append(kernel.max_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [1]


def test_only_supported_weights_are_blockable():
    assert blockable(_weights(16, 32))
    assert not blockable(_weights(24))  # not whole blocks
    assert not blockable([torch.randn(16, K), torch.randn(16, K + 1)])  # different inputs
    assert not blockable([torch.randn(16, K, dtype=torch.float64)])
    assert not blockable([torch.randn(K, 16).t()])  # not contiguous


def test_used_on_avx2_cpus_for_few_rows(monkeypatch):
    monkeypatch.setattr(onednn, "_CPU_CAPABILITY", "AVX2")
    assert blocked_matmul_pays(8)
    assert not blocked_matmul_pays(blocked_matmul.MAX_ROWS + 1)
    monkeypatch.setattr(onednn, "_CPU_CAPABILITY", "AVX512")
    assert not blocked_matmul_pays(8)


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """No kernel built before, and the process's own loaded again after the test."""
    monkeypatch.setenv("HOME", str(tmp_path))
    blocked_matmul.library.cache_clear()
    yield tmp_path / ".cache" / "magrpo" / "kernels"
    blocked_matmul.library.cache_clear()


def test_kernel_is_built_once_into_the_cache(fresh_cache):
    kernel = blocked_matmul.library()
    assert kernel is not None
    built = list(fresh_cache.iterdir())
    assert [p.suffix for p in built] == [".so"]  # no partial file left
    blocked_matmul.library.cache_clear()
    stamp = built[0].stat().st_mtime_ns
    assert blocked_matmul.library() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"])
def test_a_missing_or_failing_compiler_leaves_onednn_with_a_warning(
    compiler, fresh_cache, monkeypatch, caplog
):
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setattr(onednn, "_CPU_CAPABILITY", "AVX2")
    with caplog.at_level(logging.WARNING, logger="magrpo.speedups.blocked_matmul"):
        assert blocked_matmul.library() is None
        assert not blocked_matmul_pays(8)
    assert "oneDNN" in caplog.text
