"""Newton-Schulz orthogonalization: the matrix function at the heart of Muon.

For an m x n matrix G (m <= n, else work on G^T) with SVD G = U S V^T, Muon wants the polar
factor U V^T. The quintic iteration approximates it with matrix products only:

    X_0 = G / max(||G||_F, eps)                      (spectral norm <= 1)
    A   = X X^T
    X  <- a X + (b A + c A^2) X                      (applies p(s) = a s + b s^3 + c s^5
                                                      to every singular value)

with (a, b, c) = (3.4445, -4.7750, 2.0315) for every step ("quintic", as torch.optim.Muon),
or the per-step optimal coefficients of Polar Express (Amsel et al. 2025, arXiv 2505.16932),
divided by a 1.01 safety factor that also enlarges the normalization.

Cost per step for an m x n unit, m <= n: 2m^2n (A) + 2m^3 (A^2) + 2m^2n (B X) = 4m^2n + 2m^3.

Everything is batched over leading dimensions: a stack [N, m, n] of same-shape units is one
call, and each matrix's result depends on that matrix alone (no cross-batch reduction), so a
unit orthogonalized in any batch gives the same bits.
"""

from __future__ import annotations

from typing import Literal

import torch

Coefficients = Literal["quintic", "polar_express"]

QUINTIC = (3.4445, -4.7750, 2.0315)

# Polar Express degree-5 coefficients, one triple per step; later steps repeat the last one.
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_SAFETY = 1.01
# (a/s, b/s^3, c/s^5) evaluates p(x / s): a margin so bf16 round-off cannot push singular values
# past the interval the polynomials were optimized for; the final (converged) one is left as is.
POLAR_EXPRESS = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32}


def ns_coefficients(
    steps: int, coefficients: Coefficients | tuple[float, float, float] = "quintic"
) -> list[tuple[float, float, float]]:
    """The (a, b, c) used at each of `steps` iterations."""
    if steps < 0:
        raise ValueError(f"newton_schulz: steps must be >= 0, got {steps}")
    if coefficients == "quintic":
        return [QUINTIC] * steps
    if coefficients == "polar_express":
        return list(POLAR_EXPRESS[:steps]) + [POLAR_EXPRESS[-1]] * max(
            0, steps - len(POLAR_EXPRESS)
        )
    if isinstance(coefficients, tuple) and len(coefficients) == 3:
        return [tuple(float(v) for v in coefficients)] * steps  # type: ignore[list-item]
    raise ValueError(
        f"newton_schulz: coefficients must be 'quintic', 'polar_express' or an (a, b, c) "
        f"tuple, found {coefficients!r}"
    )


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch dtype from a config string ('bfloat16', 'float32') or a dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"ns dtype: expected one of {sorted(_DTYPES)}, found {dtype!r}")


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """FLOPs of `steps` iterations on one m x n unit (4 m'^2 n' + 2 m'^3 with m' <= n')."""
    m, n = min(m, n), max(m, n)
    return steps * (4 * m * m * n + 2 * m**3)


def newton_schulz(
    X: torch.Tensor,
    steps: int = 5,
    dtype: torch.dtype | str = torch.bfloat16,
    coefficients: Coefficients | tuple[float, float, float] = "quintic",
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate polar factor of each matrix in X [..., m, n]; same shape out, in `dtype`.

    Frobenius normalization per matrix (clamped below by eps, so a zero matrix maps to zero),
    tall matrices transposed so the Gram matrix is the small side. With the defaults and a
    2-D input this equals torch.optim.Muon's internal iteration bit for bit.
    """
    if X.ndim < 2:
        raise ValueError(f"newton_schulz: expected a matrix or a stack [..., m, n], got {X.shape}")
    if X.is_complex():
        raise ValueError("newton_schulz: complex matrices are not supported")
    lead, (m, n) = X.shape[:-2], X.shape[-2:]
    Y = X.to(resolve_dtype(dtype), copy=True).reshape(-1, m, n)
    return newton_schulz_(Y, steps, coefficients, eps).reshape(*lead, m, n)


def newton_schulz_(
    Y: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients | tuple[float, float, float] = "quintic",
    eps: float = 1e-7,
) -> torch.Tensor:
    """`newton_schulz` on a stack [N, m, n] already in the compute dtype; may overwrite Y.

    For callers that assemble the stack themselves (Muon buckets) and so skip one copy.
    """
    coeffs = ns_coefficients(steps, coefficients)
    safety = POLAR_EXPRESS_SAFETY if coefficients == "polar_express" else 1.0
    tall = Y.shape[-2] > Y.shape[-1]
    if tall:
        Y = Y.mT
    norm = torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True)
    if safety != 1.0:
        norm = norm * safety
    Y = Y.div_(norm.clamp_(min=eps))
    for a, b, c in coeffs:
        A = torch.bmm(Y, Y.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        Y = torch.baddbmm(Y, B, Y, beta=a)
    return Y.mT if tall else Y
