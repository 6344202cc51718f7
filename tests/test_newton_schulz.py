"""Newton-Schulz against torch.optim.Muon's own iteration, an fp32 reference and the SVD."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from cadenza.optim.newton_schulz import POLAR_EXPRESS, QUINTIC, newton_schulz, ns_flops

torch.set_num_threads(1)


def reference_ns(G: torch.Tensor, coeffs, eps: float = 1e-7, safety: float = 1.0) -> torch.Tensor:
    """Plain fp32 iteration on one matrix, written from the formula with no fused ops."""
    X = G.float()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / max(float(X.norm()) * safety, eps)
    for a, b, c in coeffs:
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32)])
def test_bf16_matches_torch_muon_iteration(shape):
    G = torch.randn(*shape)
    ours = newton_schulz(G)
    theirs = torch_ns(G, QUINTIC, 5, 1e-7)
    assert ours.dtype == torch.bfloat16 and ours.shape == G.shape
    # Same operations in the same order; at worst one bf16 ulp apart where kernels differ.
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-7, atol=2**-8)


@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (20, 20)])
def test_fp32_matches_reference_iteration(shape):
    G = torch.randn(*shape)
    ours = newton_schulz(G, steps=5, dtype=torch.float32)
    ref = reference_ns(G, [QUINTIC] * 5)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() <= 1e-6


def test_polar_express_fp32_matches_reference_and_svd():
    G = torch.randn(12, 40, dtype=torch.float64).float()
    ours = newton_schulz(G, steps=8, dtype="float32", coefficients="polar_express")
    ref = reference_ns(G, POLAR_EXPRESS[:8], safety=1.01)
    assert (ours - ref).abs().max() <= 1e-6
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    # Polar Express converges to the polar factor; the fixed quintic does not (S' in ~[0.7, 1.2]).
    assert (ours.double() - U @ Vh).abs().max() < 2e-2


def test_quintic_singular_values_near_one():
    G = torch.randn(16, 64)
    s = torch.linalg.svdvals(newton_schulz(G, dtype=torch.float32).double())
    assert s.min() > 0.5 and s.max() < 1.5


def test_batched_equals_each_matrix():
    G = torch.randn(2, 3, 10, 30)
    out = newton_schulz(G, dtype=torch.float32)
    assert out.shape == G.shape
    for i in range(2):
        for j in range(3):
            ref = reference_ns(G[i, j], [QUINTIC] * 5)
            assert (out[i, j] - ref).abs().max() <= 1e-6


def test_zero_matrix_gives_zero():
    out = newton_schulz(torch.zeros(3, 8, 5))
    assert torch.isfinite(out).all() and (out == 0).all()


def test_bad_inputs():
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.randn(5))
    with pytest.raises(ValueError, match="complex"):
        newton_schulz(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(torch.randn(4, 4), coefficients="cubic")
    with pytest.raises(ValueError, match="dtype"):
        newton_schulz(torch.randn(4, 4), dtype="float8")


def test_flops_formula():
    # 4 m^2 n + 2 m^3 per step on the short side m.
    assert ns_flops(64, 256, steps=1) == 4 * 64 * 64 * 256 + 2 * 64**3
    assert ns_flops(256, 64, steps=5) == 5 * (4 * 64 * 64 * 256 + 2 * 64**3)
