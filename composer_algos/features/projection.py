"""Randomized-FFT (FJLT-style) compression of gradient features: random signs, orthonormal real FFT, subsampling.

Shapes: n rows, D input features (Dp after zero-padding to an FFT-friendly length), d output features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from composer_algos.features.sketch import PURPOSE_FJLT, derive_seed, make_generator

__all__ = ["FJLTPlan", "FJLTStack", "make_fjlt_plan", "apply_fjlt", "stack_fjlt_plans", "fjlt_stack", "fjlt_project", "next_fast_len"]


@dataclass(frozen=True)
class FJLTPlan:
    """The random choices of one layer's projection R^D -> R^d (a function of seed, layer, D, d only).

    Attributes:
        dim_in: D.
        dim_out: d.
        signs_D: random +-1 per input coordinate.
        index_d: for `d < D`, positions in the flattened `view_as_real(rfft(x, Dp))`; for `d >= D`, the
            distinct output positions the input is embedded at.
        scale_d: per-output scale (sqrt(2) for paired real/imaginary parts, times sqrt(Dp/d)); None
            when embedding.
        fft_len: Dp, the padded FFT length (0 when embedding).
    """

    dim_in: int
    dim_out: int
    signs_D: torch.Tensor
    index_d: torch.Tensor
    scale_d: torch.Tensor | None
    fft_len: int


def make_fjlt_plan(
    seed: int,
    layer_index: int,
    dim_in: int,
    dim_out: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    step: int | None = None,
) -> FJLTPlan:
    """Draw the projection of one layer: x -> sqrt(Dp/d) * S(F_real(signs * pad(x))).

    `F_real` is the orthonormal real DFT: the `norm="ortho"` rfft coefficients written as
    [X_0, sqrt2 Re X_k, sqrt2 Im X_k (0 < k < Dp/2), X_{Dp/2} (Dp even)], an orthogonal Dp x Dp map.
    `S` keeps d of its Dp coordinates uniformly without replacement, so `E[P^T P] = I` and inner
    products are unbiased; the random signs spread any input over all frequencies, which is what gives
    the Johnson-Lindenstrauss concentration (Ailon & Chazelle 2006). When `d >= D` no compression is
    needed and the plan is an isometric embedding (signed copy into d random distinct positions).

    Args:
        seed: base seed.
        layer_index: folded into the seed.
        dim_in: D.
        dim_out: d (>= 1).
        device: where the plan's tensors live.
        dtype: dtype of the signs and scales (match the features).
        step: folded into the seed when projections are redrawn each step.

    Returns:
        The plan; the same arguments always give the same plan.

    Raises:
        ValueError: for non-positive dimensions.
    """
    if dim_in < 1 or dim_out < 1:
        raise ValueError(f"FJLT dimensions must be >= 1, got dim_in={dim_in}, dim_out={dim_out}")
    gen = make_generator(derive_seed(seed, layer_index, PURPOSE_FJLT, step))
    # Drawn on the host (the same plan on every device) and copied without making the host wait.
    signs_D = (torch.randint(0, 2, (dim_in,), generator=gen, dtype=torch.int8) * 2 - 1).to(device, dtype, non_blocking=True)
    if dim_out >= dim_in:
        index_d = torch.randperm(dim_out, generator=gen)[:dim_in].to(device, non_blocking=True)
        return FJLTPlan(dim_in, dim_out, signs_D, index_d, None, 0)

    fft_len = next_fast_len(dim_in)
    n_freq_pairs = (fft_len - 1) // 2  # frequencies with independent real and imaginary parts
    valid = [0] + [j for k in range(1, n_freq_pairs + 1) for j in (2 * k, 2 * k + 1)]
    scale = [1.0] + [math.sqrt(2.0)] * (2 * n_freq_pairs)
    if fft_len % 2 == 0:
        valid.append(fft_len)  # the Nyquist coefficient's real part, at 2 * (fft_len // 2)
        scale.append(1.0)
    assert len(valid) == fft_len
    keep = torch.randperm(fft_len, generator=gen)[:dim_out].sort().values
    index_d = torch.tensor(valid, dtype=torch.long)[keep].to(device, non_blocking=True)
    scale_d = (torch.tensor(scale, dtype=torch.float64)[keep] * math.sqrt(fft_len / dim_out)).to(device, dtype, non_blocking=True)
    return FJLTPlan(dim_in, dim_out, signs_D, index_d, scale_d, fft_len)


def apply_fjlt(
    x_nD: torch.Tensor,
    plan: FJLTPlan,
    out_nd: torch.Tensor | None = None,
    col_scale_D: torch.Tensor | None = None,
) -> torch.Tensor:
    """Project the rows of `x_nD` (optionally column-scaled first) with `plan`, adding into `out_nd` when given.

    Summing the projections of several layers (each with its own independent plan) into one `out_nd`
    is itself an unbiased JL map of the concatenated features: cross-layer terms have zero mean
    because the layers' random signs are independent.

    Args:
        x_nD: (n, D) features.
        plan: from `make_fjlt_plan` with `dim_in == D`.
        out_nd: optional (n, d) accumulator, updated in place.
        col_scale_D: optional (D,) scale applied to the columns before projecting (folded into the
            random signs, so an elementwise preconditioner costs no extra pass over `x_nD`).

    Returns:
        (n, d) projected features (`out_nd` itself when given).

    Raises:
        ValueError: when `x_nD` does not have `plan.dim_in` columns.
    """
    n, dim_in = x_nD.shape
    if dim_in != plan.dim_in:
        raise ValueError(f"features have {dim_in} columns but the FJLT plan expects {plan.dim_in}")
    if out_nd is None:
        out_nd = x_nD.new_zeros(n, plan.dim_out)
    signs_D = plan.signs_D if col_scale_D is None else plan.signs_D * col_scale_D
    signed_nD = x_nD * signs_D
    if plan.scale_d is None:
        return out_nd.index_add_(1, plan.index_d, signed_nD)
    coeffs_nF = torch.fft.rfft(signed_nD, n=plan.fft_len, dim=1, norm="ortho")
    flat_n2F = torch.view_as_real(coeffs_nF).reshape(n, -1)
    return out_nd.add_(flat_n2F.index_select(1, plan.index_d) * plan.scale_d)


@dataclass(frozen=True)
class FJLTStack:
    """The plans of L layers of one input width D, stacked so that one call projects them all (`fjlt_stack`).

    Attributes:
        signs_LD: (L, D) the layers' random signs.
        index_Ld: (L, d) the FFT positions each layer keeps; for an embedding (d >= D) the flat
            (L D,) output positions of every layer's inputs, in layer order.
        scale_Ld: (L, d) per-output scales; None for an embedding.
        fft_len: the common padded length (0 for an embedding).
        dim_out: d.
    """

    signs_LD: torch.Tensor
    index_Ld: torch.Tensor
    scale_Ld: torch.Tensor | None
    fft_len: int
    dim_out: int


def stack_fjlt_plans(plans: list[FJLTPlan]) -> FJLTStack:
    """Stack plans of one input and output width (raises ValueError otherwise)."""
    if len({(p.dim_in, p.dim_out, p.fft_len) for p in plans}) != 1:
        raise ValueError("stack_fjlt_plans: the plans must share their input width, output width and FFT length")
    signs_LD = torch.stack([p.signs_D for p in plans])
    if plans[0].scale_d is None:
        return FJLTStack(signs_LD, torch.cat([p.index_d for p in plans]), None, 0, plans[0].dim_out)
    scale_Ld = torch.stack([p.scale_d for p in plans])  # type: ignore[misc]
    return FJLTStack(signs_LD, torch.stack([p.index_d for p in plans]), scale_Ld, plans[0].fft_len, plans[0].dim_out)


def fjlt_stack(x_LnD: torch.Tensor, plans: FJLTStack) -> torch.Tensor:
    """`sum_l apply_fjlt(x_LnD[l], plan_l)` in a handful of kernels: the L layers' projections summed, (n, d).

    One signed product, then one batched FFT with one gather of the kept coefficients, or for an
    embedding one scatter of every layer's signed inputs into the output (contributions added in
    layer order, as the layer-by-layer sum).
    """
    L, n, dim_in = x_LnD.shape
    if plans.signs_LD.shape != (L, dim_in):
        raise ValueError(f"features have shape {tuple(x_LnD.shape)} but the stacked plans expect ({plans.signs_LD.shape[0]}, n, {plans.signs_LD.shape[1]})")
    if plans.scale_Ld is None:
        # The signed inputs written row-major as (n, L D) by the product itself (no transposed copy).
        signed_nLD = torch.empty(n, L, dim_in, dtype=x_LnD.dtype, device=x_LnD.device)
        torch.mul(x_LnD.transpose(0, 1), plans.signs_LD, out=signed_nLD)
        out_nd = x_LnD.new_zeros(n, plans.dim_out)
        return out_nd.index_add_(1, plans.index_Ld, signed_nLD.view(n, L * dim_in))
    signed_LnD = x_LnD * plans.signs_LD.unsqueeze(1)
    coeffs_LnF = torch.fft.rfft(signed_LnD, n=plans.fft_len, dim=2, norm="ortho")
    flat_Ln2F = torch.view_as_real(coeffs_LnF).flatten(2)
    kept_Lnd = flat_Ln2F.gather(2, plans.index_Ld.unsqueeze(1).expand(L, n, -1))
    return (kept_Lnd * plans.scale_Ld.unsqueeze(1)).sum(dim=0)


def fjlt_project(
    x_nD: torch.Tensor, dim_out: int, *, seed: int = 0, layer_index: int = 0, step: int | None = None
) -> torch.Tensor:
    """Convenience: draw the plan for `(seed, layer_index, D, dim_out)` on `x_nD`'s device and apply it.

    Args:
        x_nD: (n, D) features.
        dim_out: d.
        seed: base seed.
        layer_index: folded into the seed.
        step: folded into the seed when not None.

    Returns:
        (n, d) projected features.
    """
    plan = make_fjlt_plan(seed, layer_index, x_nD.shape[1], dim_out, device=x_nD.device, dtype=x_nD.dtype, step=step)
    return apply_fjlt(x_nD, plan)


def next_fast_len(n: int) -> int:
    """The smallest integer >= n whose prime factors are 2, 3 and 5 (fast for every FFT backend)."""
    best = 1 << max(0, (n - 1).bit_length())
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            m = p35
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 3
        p5 *= 5
    return best
