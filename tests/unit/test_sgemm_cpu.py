"""tallyserve's AVX2 float32 product (tallyserve_cpu::linear_sgemm on pack_sgemm_weight's panels): x @ w^T against a
float64 reference for row counts around its 6-row tiles, 72-row blocks and 512-row tasks, output features past a
16-wide panel, any thread count with bit-identical results, and clear errors for inputs it does not take."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tallyserve.kernels import cpu_kernels
from tallyserve.models import cpu_products, layers
from tests.kernel_errors import RAW_THROW

pytestmark = pytest.mark.skipif(not (cpu_kernels.load() and torch.ops.tallyserve_cpu.sgemm_built()),
                                reason="the kernels were built without AVX2 + FMA")


def product(x, w, threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return torch.ops.tallyserve_cpu.linear_sgemm(x, torch.ops.tallyserve_cpu.pack_sgemm_weight(w), w.shape[0])
    finally:
        torch.set_num_threads(prev)


@settings(max_examples=40, deadline=None)
@given(m=st.sampled_from([1, 2, 5, 6, 7, 64, 71, 72, 73, 150, 511, 513, 1100]), n=st.integers(1, 70),
       k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_product_equals_the_reference_at_any_thread_count(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    one, two = product(x, w, 1), product(x, w, 2)
    assert one.shape == (m, n) and one.dtype == torch.float32
    assert torch.equal(one, two)  # sums over k in order: the split of rows and panels changes nothing
    ref = (x.double() @ w.double().T)
    bound = 1e-6 * (x.double().abs() @ w.double().abs().T) + 1e-30  # float32 rounding of a k-term sum
    assert ((one.double() - ref).abs() <= bound * k).all()


def test_wide_products_and_the_model_shapes():
    """The bundled model's shapes, decode and prompt rows: within float32 rounding of the reference."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in [(64, 960, 576), (1024, 3072, 576), (64, 576, 1536), (3, 49152, 64)]:
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        torch.testing.assert_close(product(x, w, 2), (x.double() @ w.double().T).float(), atol=2e-4, rtol=1e-5)


def test_linear_takes_the_panels_and_keeps_biases_and_dtypes():
    w, b = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(9, 24)
    assert cpu_products.pack_sgemm_weight(w)
    got = layers.linear(x, w, b)
    assert torch.allclose(got, x @ w.T + b, atol=1e-5)
    assert layers.linear(x, w, out_dtype=torch.float64).dtype == torch.float64
    assert not cpu_products.pack_sgemm_weight(torch.randn(4, 4, dtype=torch.bfloat16))  # float32 weights only


def test_linear_refuses_features_that_do_not_match_the_panels():
    """layers.linear checks x's features against the weight before the kernel (ValueError, not its TORCH_CHECK)."""
    w = torch.randn(20, 8)
    assert cpu_products.pack_sgemm_weight(w)
    with pytest.raises(ValueError, match="does not match the weight"):
        layers.linear(torch.randn(3, 9), w)


@RAW_THROW
@pytest.mark.parametrize("x,n,message", [
    (torch.randn(3, 8).t(), 16, "contiguous float32"),
    (torch.randn(3, 9), 16, "packed must come from"),
    (torch.randn(3, 8, dtype=torch.float64), 16, "contiguous float32"),
    (torch.randn(3, 8), 33, "N does not match"),
    (torch.randn(3, 8), 0, "N does not match"),
])
def test_bad_inputs_are_clear_errors(x, n, message):
    packed = torch.ops.tallyserve_cpu.pack_sgemm_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tallyserve_cpu.linear_sgemm(x, packed, n)


def test_zero_rows():
    packed = torch.ops.tallyserve_cpu.pack_sgemm_weight(torch.randn(20, 8))
    assert torch.ops.tallyserve_cpu.linear_sgemm(torch.empty(0, 8), packed, 20).shape == (0, 20)
