"""Per-example gradients of a linear layer from its inputs and output-gradients: exact, or two-sided sketched.

Shapes: n examples, T tokens, O = d_out, I = d_in (I+1 with a bias column), K = k_out, J = k_in.
"""

from __future__ import annotations

import torch

from composer_algos.seeding import splitmix_seed

__all__ = [
    "derive_seed",
    "make_generator",
    "sketch_matrices",
    "exact_layer_grads",
    "sketch_layer_grads",
    "sketched_layer_products",
    "compute_dtype",
]

# Purposes folded into the seeds so that different random objects of one layer are independent.
PURPOSE_SKETCH_OUT = 1
PURPOSE_SKETCH_IN = 2
PURPOSE_FJLT = 3


def derive_seed(seed: int, layer_index: int, purpose: int, step: int | None = None) -> int:
    """A 63-bit seed that depends on (base seed, layer index, purpose[, step]) and nothing else.

    Args:
        seed: the user's base seed.
        layer_index: the target layer's index, folded in so layers get independent projections.
        purpose: which random object (sketch out / sketch in / FJLT).
        step: folded in only when projections are redrawn every step; None keeps them fixed.

    Returns:
        A non-negative int usable with `torch.Generator.manual_seed`.
    """
    return splitmix_seed(seed, layer_index, purpose, -1 if step is None else step)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with `seed` (projections are drawn on CPU so every device sees the same ones)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def sketch_matrices(
    seed: int,
    layer_index: int,
    d_out: int,
    d_in: int,
    k_out: int,
    k_in: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    step: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded Rademacher projections for the two sides of a layer's gradient.

    Entries are +-1/sqrt(k), so `E[P^T P] = I` on each side and the sketch
    `P_out (sum_t delta_t a_t^T) P_in^T` preserves Frobenius inner products in expectation
    (Rademacher rather than Gaussian entries: same expectation, lower variance).

    Args:
        seed: base seed.
        layer_index: the layer's index (folded into the seed).
        d_out: columns of `P_out` (the layer's output size).
        d_in: columns of `P_in` (input size, +1 when the bias is included).
        k_out: rows of `P_out`.
        k_in: rows of `P_in`.
        device: where the matrices are returned.
        dtype: their dtype.
        step: folded into the seed when projections are redrawn each step.

    Returns:
        P_out_KO (k_out, d_out) and P_in_JI (k_in, d_in).
    """
    out = []
    for purpose, k, d in ((PURPOSE_SKETCH_OUT, k_out, d_out), (PURPOSE_SKETCH_IN, k_in, d_in)):
        gen = make_generator(derive_seed(seed, layer_index, purpose, step))
        signs = torch.randint(0, 2, (k, d), generator=gen, dtype=torch.int8).to(torch.float64) * 2 - 1
        out.append((signs / k**0.5).to(device=device, dtype=dtype, non_blocking=True))  # drawn on the host
    return out[0], out[1]


def exact_layer_grads(a_nTI: torch.Tensor, delta_nTO: torch.Tensor, has_bias: bool) -> torch.Tensor:
    """Exact per-example gradient of a linear layer, flattened.

    Args:
        a_nTI: the layer's inputs (n, T, I).
        delta_nTO: d(sum of per-example losses)/d(layer output) (n, T, O); row i only carries example
            i's loss because examples do not interact in eval mode.
        has_bias: append the bias gradient `sum_t delta_t`.

    Returns:
        (n, O*I [+ O]): the row-major weight gradient, then the bias gradient.
    """
    n = a_nTI.shape[0]
    grad_nOI = torch.einsum("nto,nti->noi", delta_nTO, a_nTI)
    if not has_bias:
        return grad_nOI.reshape(n, -1)
    return torch.cat([grad_nOI.reshape(n, -1), delta_nTO.sum(dim=1)], dim=1)


def sketch_layer_grads(
    a_nTI: torch.Tensor,
    delta_nTO: torch.Tensor,
    P_out_KO: torch.Tensor,
    P_in_JI: torch.Tensor,
) -> torch.Tensor:
    """Two-sided sketch `P_out G_i P_in^T` of each example's gradient `G_i = sum_t delta_t a_t^T`, flattened.

    Never forms `G_i`: it projects both sides token-wise first, costing O(n T (O K + I J + K J)).
    When `P_in` has one more column than `a` has features, that column is the bias (an implicit
    constant-1 input), so the sketch covers `[W | b]`.

    Args:
        a_nTI: inputs (n, T, I).
        delta_nTO: output-gradients (n, T, O).
        P_out_KO: (K, O) output-side projection (possibly pre-scaled, see normalize.py).
        P_in_JI: (J, I) or (J, I+1) input-side projection.

    Returns:
        (n, K*J) sketches.
    """
    n, _, d_in = a_nTI.shape
    u_nTK = delta_nTO @ P_out_KO.T
    w_nTJ = a_nTI @ P_in_JI[:, :d_in].T
    if P_in_JI.shape[1] == d_in + 1:
        w_nTJ = w_nTJ + P_in_JI[:, d_in]
    else:
        assert P_in_JI.shape[1] == d_in, "P_in must have d_in or d_in + 1 columns"
    return torch.einsum("ntk,ntj->nkj", u_nTK, w_nTJ).reshape(n, -1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the products run in: at least float32 (`torch.promote_types(dtype, float32)`, without an aten op)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.promote_types(dtype, torch.float32)


def sketched_layer_products(
    inputs: list[torch.Tensor],
    in_projections: list[torch.Tensor],
    layer_groups: tuple[tuple[int, ...], ...],
    deltas: list[torch.Tensor],
    out_projections: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    k_in: int,
) -> torch.Tensor:
    """`sketch_layer_grads` of L layers in a few kernels: the (L, n, K J) sketches, stacked.

    The projections come transposed, so each product is one matmul with no transpose. Layers that
    read one input share its projection (one matmul for q, k and v, one for gate and up):
    `inputs[g]` (n, T, I_g) is read by the layers `layer_groups[g]`, whose input-side projections
    stand side by side in `in_projections[g]` (I_g, len_g J), layer by layer. Each layer's output
    side is `deltas[l] @ out_projections[l]` (O_l, K); `biases[l]` is its projection's bias column
    (or None). `k_in` is the width of one layer's block of `in_projections[g]` (and of its bias).
    The inputs and output gradients are upcast to at least float32 first. A pure
    function of its tensors, so `torch.compile` can capture it (`GradFeatureExtractor(compile=True)`).

    Returns:
        (L, n, K J), layer l's row i the flattened `P_out G_i P_in^T` of `sketch_layer_grads`.
    """
    # The products on (n T, width) views: what a 3-D matmul does itself, without its final reshape.
    n, T = int(deltas[0].shape[0]), int(deltas[0].shape[1])
    w_by_layer: list[torch.Tensor] = [deltas[0]] * len(deltas)  # placeholders, each replaced below
    for a_nTI, P_in_IG, positions in zip(inputs, in_projections, layer_groups):
        w_NG = a_nTI.to(compute_dtype(a_nTI.dtype)).reshape(n * T, -1) @ P_in_IG
        for i, pos in enumerate(positions):
            w = w_NG if len(positions) == 1 else w_NG.narrow(1, i * k_in, k_in)
            bias = biases[pos]
            w_by_layer[pos] = w if bias is None else w + bias
    u = [d.to(compute_dtype(d.dtype)).reshape(n * T, -1) @ P_out_OK for d, P_out_OK in zip(deltas, out_projections)]
    u_LNK, w_LNJ = torch.stack(u), torch.stack(w_by_layer)
    L = u_LNK.shape[0]
    # One batched product over (layer, row): sum over tokens of u_t (x) w_t.
    x_BKJ = torch.bmm(u_LNK.view(L * n, T, -1).transpose(1, 2), w_LNJ.view(L * n, T, -1))
    return x_BKJ.view(L, n, -1)
