"""The model's linear layers through oneDNN instead of the BLAS library, on CPU.

torch sends a float32 ``F.linear`` on CPU to its BLAS library's generic GEMM (MKL in the
x86 wheels) and only lower precisions to oneDNN. Which is faster depends on the CPU
(``benchmarks/linear_kernels.py``):

- at a decode step's 8 rows, oneDNN on a weight first reordered into its blocked layout,
  everywhere we measured: 1.6-3.8x on an AMD Zen 4 (AVX-512), 1.5-2.9x on a Zen 3 (AVX2);
- at an update's few hundred rows on the weight as it is, oneDNN on AVX-512 (Zen 4:
  1.05-1.4x forward, 1.4-1.9x input gradient) but MKL on AVX2 (Zen 3: the LoRA update took
  5.0 s with MKL against 6.1-7.0 s with oneDNN, in one process, alternating).

So:

- :func:`onednn_linears` ``(model, pack_rows=...)``, for decoding (no gradients): each
  weight is packed once per call of the block; the packed copies (one copy of the linear
  weights) live only while it runs, and a training step's peak, reached in the update, is
  unchanged.
- :func:`onednn_linears` ``(model)``, for the training pass, where :func:`plain_weights_pay`:
  plain weights, no copies, an autograd function whose input gradient is oneDNN's too (the
  weight gradient of full fine-tuning stays torch's, as fast here on transposed operands).

Results differ from ``F.linear`` by float rounding only (another summation order). Outside
a block, and where oneDNN or the dtype is not supported (GPU, float64, other builds), the
layers are torch's own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from magrpo.speedups.heap import release_free_heap
from magrpo.speedups.module_patching import forwards_replaced, is_patched


def onednn_available(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


# what the CPU kernels of this torch build were dispatched for ("AVX2", "AVX512", ...)
_CPU_CAPABILITY = torch.backends.cpu.get_cpu_capability()


def plain_weights_pay() -> bool:
    """Whether oneDNN on the weights as they are beats the BLAS library at the training
    pass's products: measured so on AVX-512 CPUs, and the other way round on AVX2 (above)."""
    return _CPU_CAPABILITY.startswith("AVX512")


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """float32 always; bfloat16 only on CPUs with the instructions oneDNN's bfloat16 products
    need (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): on an AVX2-only CPU (e.g. AMD Zen 3) oneDNN
    refuses them, and torch's own kernels run instead."""
    if dtype == torch.float32:
        return True
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return dtype == torch.bfloat16 and supported is not None and bool(supported())


@contextlib.contextmanager
def onednn_linears(model: torch.nn.Module, pack_rows: int | None = None) -> Iterator[None]:
    """Within the block, every ``nn.Linear`` of ``model`` runs through oneDNN.

    ``pack_rows``: multiply with copies of the weights packed for about that many input
    rows (inference only: no gradients, and a block must not span an optimizer step).
    A no-op where oneDNN is unavailable, and without ``pack_rows`` where the BLAS library
    is the faster (:func:`plain_weights_pay`).
    """
    parameter = next(model.parameters(), None)
    if (
        parameter is None
        or not onednn_available(parameter.device)
        or (pack_rows is None and not plain_weights_pay())
    ):
        yield
        return
    if pack_rows is not None:
        release_free_heap()  # the copies then take pages the update freed, not new ones
    packed: dict[int, torch.Tensor] = {}
    forwards = {}
    for module in model.modules():
        if type(module) is not torch.nn.Linear or is_patched(module):
            continue
        if not onednn_supports(module.weight.dtype):
            continue
        if pack_rows is None:
            forwards[module] = functools.partial(_linear, module)
            continue
        weight = module.weight
        if id(weight) not in packed:  # tied weights are packed once
            packed[id(weight)] = pack_weight(weight, pack_rows)
        forwards[module] = functools.partial(_packed_linear, module, packed[id(weight)])
    try:
        with forwards_replaced(forwards):
            yield
    finally:  # the packed copies go now, not whenever the generator's frame is collected
        forwards.clear()
        packed.clear()


def matmul_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no autograd), by oneDNN where it can run it."""
    if x.dtype == weight.dtype and onednn_supports(x.dtype) and onednn_available(x.device):
        return inner_product(x, weight)
    return x @ weight.t()


def pack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """A copy of a linear ``weight`` in oneDNN's blocked layout, for about ``rows`` input
    rows (no gradients flow through it); multiply with :func:`inner_product`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def inner_product(
    x: torch.Tensor, weight: torch.Tensor, bias=None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T + bias (+ ``residual``, added inside the product) by oneDNN
    (``weight`` packed or plain, any strides)."""
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")


def _packed_linear(module: torch.nn.Linear, packed: torch.Tensor, x: torch.Tensor):
    if x.dtype != packed.dtype or torch.is_grad_enabled() and module.weight.requires_grad:
        return F.linear(x, module.weight, module.bias)
    return inner_product(x, packed, module.bias)


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != module.weight.dtype:
        return F.linear(x, module.weight, module.bias)
    return _OneDNNLinear.apply(x, module.weight, module.bias)


class _OneDNNLinear(torch.autograd.Function):
    """F.linear with oneDNN in the forward and in the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        # What each gradient needs, and only that: a frozen weight keeps no input alive.
        ctx.save_for_backward(
            weight if x.requires_grad else None, x if weight.requires_grad else None
        )
        ctx.has_bias = bias is not None
        return inner_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        weight, x = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = inner_product(grad_output, weight.t())
        if ctx.needs_input_grad[1]:
            rows_out = grad_output.reshape(-1, grad_output.shape[-1])
            rows_in = x.reshape(-1, x.shape[-1])
            grad_weight = rows_out.t() @ rows_in  # torch's: oneDNN gains nothing here
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_x, grad_weight, grad_bias
