"""Normalisations of per-example gradient features: the optimizer's Adam preconditioner, the paper's simulated Adam filter, unit rows.

Shapes: n rows, D features of one layer, O = d_out, I = d_in (I+1 with a bias column).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from composer_algos.features.targets import FlatSlice, ParamShard

log = logging.getLogger(__name__)

__all__ = [
    "NORMALIZATIONS",
    "optimizer_second_moments",
    "exact_adam_scale",
    "factored_adam_scales",
    "batched_factored_scales",
    "FactoredScales",
    "sharded_adam_scales",
    "SimulatedAdam",
    "unit_rows",
]

NORMALIZATIONS = ("none", "unit", "adam_optimizer", "adam_simulated")


def optimizer_second_moments(
    optimizer: torch.optim.Optimizer | None, params: Sequence[torch.nn.Parameter | FlatSlice]
) -> list[torch.Tensor] | None:
    """The optimizer's bias-corrected second moments `v_hat = exp_avg_sq / (1 - beta2**step)` for `params`.

    Works with any optimizer that keeps Adam's `exp_avg_sq` and `step` per parameter and `betas` per
    group: `torch.optim.Adam`, `AdamW` and Composer's `DecoupledAdamW`. The correction is the one Adam
    applies to its own denominator, so the features are preconditioned exactly like the next update.

    Args:
        optimizer: the training optimizer, or None.
        params: parameters in feature order; a `FlatSlice` for one whose state is part of FSDP's flat
            parameter's (`use_orig_params=False`, units holding whole parameters).

    Returns:
        One tensor per parameter (same shape), or None when the optimizer is missing or holds no
        second moment for some parameter yet (step 0, or a frozen parameter): the caller then uses
        that layer without the preconditioner for this call.
    """
    if optimizer is None:
        return None
    beta2_of = {id(p): group.get("betas", (0.9, 0.999))[1] for group in optimizer.param_groups for p in group["params"]}
    out = []
    for p in params:
        key = p.flat_param if isinstance(p, FlatSlice) else p
        state = optimizer.state.get(key)
        if not state or "exp_avg_sq" not in state or id(key) not in beta2_of:
            return None
        v = state["exp_avg_sq"]
        if isinstance(p, FlatSlice):
            v = v.reshape(-1)[p.offset : p.offset + p.shape.numel()].view(p.shape)
        step = state.get("step", 1)
        correction = 1.0 - beta2_of[id(key)] ** step
        out.append(v / correction)
    return out


def exact_adam_scale(v_hats: Sequence[torch.Tensor], eps: float) -> torch.Tensor:
    """Elementwise Adam preconditioner `1 / (sqrt(v_hat) + eps)` flattened in feature order (weight, then bias).

    Args:
        v_hats: from `optimizer_second_moments`, for one layer's weight (O, I) and optional bias (O,).
        eps: Adam's epsilon.

    Returns:
        (D,) scale to multiply the layer's exact features by.
    """
    return torch.cat([(v.sqrt() + eps).reciprocal().reshape(-1) for v in v_hats])


def factored_adam_scales(v_hats: Sequence[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column scales approximating the Adam preconditioner of a sketched layer.

    A sketch never forms the per-example gradient, so an elementwise preconditioner cannot be applied.
    We approximate `v` (O x (I[+1]), the bias as an extra column) by the rank-one fit Adafactor uses,
    `v_ij ~ r_i c_j / mean(v)` with row means `r` and column means `c` (exact when `v` is rank one),
    so `sqrt(v_ij) ~ A_i B_j` with `A = sqrt(r / sqrt(mean v))`, `B = sqrt(c / sqrt(mean v))`. The
    preconditioned gradient `diag(s_out) G diag(s_in)` is then sketched by scaling the projections'
    columns: `P_out diag(s_out)` and `P_in diag(s_in)`. Adam's `+ eps` cannot be factored exactly; we
    use `s_out = 1 / (A + eps / (2 mean B))` and `s_in = 1 / (B + eps / (2 mean A))`, whose product is
    `1 / (A_i B_j + ~eps + O(eps^2))` (the means are floored at sqrt(eps) so an all-zero `v` stays finite).

    Args:
        v_hats: the weight's (O, I) and optional bias's (O,) second moments.
        eps: Adam's epsilon.

    Returns:
        s_out_O (O,) and s_in_I (I,) or (I+1,) with the bias.
    """
    v_OI = v_hats[0]
    if len(v_hats) > 1:
        v_OI = torch.cat([v_OI, v_hats[1].reshape(-1, 1)], dim=1)
    v_OI = v_OI.float() if v_OI.dtype in (torch.float16, torch.bfloat16) else v_OI
    return _factored_scales(v_OI.mean(dim=1), v_OI.mean(dim=0), v_OI.mean(), eps)


class FactoredScales(list):
    """`[(s_out_O, s_in_I)]` per layer, views of `flat`: every layer's `s_out` concatenated, then every `s_in`."""

    flat: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, s_out: torch.Tensor, s_in: torch.Tensor, rows_O: Sequence[int], cols_I: Sequence[int]) -> FactoredScales:
        """The per-layer scales of the concatenated `s_out` and `s_in` (layer l: `rows_O[l]`, `cols_I[l]` of them)."""
        out = cls(zip(s_out.split(list(rows_O)), s_in.split(list(cols_I))))
        out.flat = (s_out, s_in)
        return out

    def powered(self, power: float) -> FactoredScales:
        """Every scale raised to `power` (two kernels: the concatenated vectors')."""
        s_out, s_in = (s.pow(power) for s in self.flat)
        return FactoredScales.of(s_out, s_in, [o.shape[0] for o, _ in self], [i.shape[0] for _, i in self])


def batched_factored_scales(
    optimizer: torch.optim.Optimizer | None, weights: Sequence[torch.nn.Parameter], eps: float
) -> FactoredScales | None:
    """`factored_adam_scales` of several bias-free layers at once, in a few kernels instead of ~20 a layer.

    The rank-one fit needs only the row means, column means and overall mean of each layer's
    `v_hat = exp_avg_sq / (1 - beta2**step)`: they are taken of `exp_avg_sq` (no full-size
    division), divided by each layer's correction, and the arithmetic of `_factored_scales` runs on
    every layer's rows and columns at once, concatenated (2 L segments: the rows of each layer,
    then the columns of each layer), each element with its layer's scalars (a segment index).
    The same values as layer by layer, to the rounding of the reordered operations.

    Args:
        optimizer: the training optimizer.
        weights: each layer's (O, I) weight.
        eps: Adam's epsilon.

    Returns:
        `[(s_out_O, s_in_I)]` per layer (with `.flat`, the same values concatenated), or None when
        some weight has no Adam state (the caller then goes layer by layer, which handles that) or
        is not a matrix.
    """
    if optimizer is None or not weights:
        return None
    if all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in weights):  # the shapes' constants, made once (state or not)
        _segments(*_shapes(weights), weights[0].device, _state_dtype(weights[0].dtype))
    beta2_of = {id(p): g.get("betas", (0.9, 0.999))[1] for g in optimizer.param_groups for p in g["params"]}
    states = [optimizer.state.get(p) for p in weights]
    if any(not st or "exp_avg_sq" not in st or id(p) not in beta2_of for p, st in zip(weights, states)):
        return None
    v = [st["exp_avg_sq"] for st in states]  # type: ignore[index]
    if any(x.dim() != 2 for x in v):
        return None
    device = v[0].device
    dtype = _state_dtype(v[0].dtype)
    steps = [st.get("step", 1) for st in states]  # type: ignore[union-attr]
    # The correction in the step's own dtype, as `optimizer_second_moments` computes it.
    if all(isinstance(t, torch.Tensor) for t in steps):
        # Stacked where they are (the host, for most optimizers), then moved at once.
        step_L = torch.stack([(t if t.dim() == 0 else t.reshape(())).to(steps[0].device) for t in steps])
        step_L = step_L.to(device, non_blocking=True)
    else:
        step_L = torch.tensor([float(t) for t in steps], dtype=torch.float64).to(device, non_blocking=True)
    rows_O, cols_I = _shapes(v)
    seg, seg_layer, seg_other, n_2L = _segments(rows_O, cols_I, device, dtype)
    beta2_L = _constant(tuple(beta2_of[id(p)] for p in weights), device, step_L.dtype)
    L = len(v)
    correction_L = 1.0 - beta2_L**step_L
    means = torch.cat([x.to(dtype).mean(dim=1) for x in v] + [x.to(dtype).mean(dim=0) for x in v])
    means = means / correction_L.index_select(0, seg_layer)
    # Per segment: the mean of the layer's row means (its overall mean), of its column means.
    mean_2L = means.new_zeros(2 * L).index_add_(0, seg, means) / n_2L
    root_mean_L = mean_2L[:L].clamp_min(torch.finfo(dtype).tiny).sqrt()
    AB = (means / root_mean_L.index_select(0, seg_layer)).sqrt()  # A of the rows, B of the columns
    floor = eps**0.5
    mean_AB_2L = AB.new_zeros(2 * L).index_add_(0, seg, AB) / n_2L
    # Each row's s_out takes eps / (2 mean B) of its layer, each column's s_in eps / (2 mean A).
    scales = (AB + (eps / (2 * mean_AB_2L.clamp_min(floor))).index_select(0, seg_other)).reciprocal()
    s_out, s_in = scales.split([sum(rows_O), sum(cols_I)])
    return FactoredScales.of(s_out, s_in, rows_O, cols_I)


def _shapes(matrices: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The rows and the columns of each matrix."""
    return tuple(int(x.shape[0]) for x in matrices), tuple(int(x.shape[1]) for x in matrices)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scales are computed in: float32 for a half-precision state."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@functools.lru_cache(maxsize=8)
def _segments(
    rows_O: tuple[int, ...], cols_I: tuple[int, ...], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """`batched_factored_scales`' constants of one set of layer shapes (made once, then reused).

    Over the concatenated rows then columns of the L layers: each element's segment (layer l's rows
    l, its columns L + l), its layer, the segment holding its other side (rows: their layer's
    columns; columns: its rows); and each segment's size (2 L,) in `dtype`.
    """
    L = len(rows_O)
    sizes = torch.tensor(rows_O + cols_I)
    seg = torch.arange(2 * L).repeat_interleave(sizes)
    other = torch.cat([torch.arange(L, 2 * L), torch.arange(L)]).repeat_interleave(sizes)
    return tuple(x.to(device, non_blocking=True) for x in (seg, seg % L, other, sizes.to(dtype)))


@functools.lru_cache(maxsize=8)
def _constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a tensor on `device` (made once, then reused)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def sharded_adam_scales(
    optimizer: torch.optim.Optimizer | None,
    layers: Sequence[tuple[Sequence[torch.nn.Parameter], int, int, bool]],
    shards: Mapping[int, ParamShard],
    eps: float,
    all_reduce_sum: Callable[[torch.Tensor], None],
) -> list[tuple[torch.Tensor, ...] | None]:
    """The Adam preconditioners of the target layers when FSDP shards their optimizer state (one collective).

    Under FSDP each rank's optimizer holds `exp_avg_sq` only for its 1-D slice of every parameter (see
    `targets.ParamShard`). Every rank writes what it holds into one float64 buffer and a single
    all-reduce (sum) completes it on every rank:

    - an exact layer (small: `d_out * d_in <= exact_max_numel`) contributes its slice of the whole
      flattened `v_hat` (weight, then bias), from which `exact_adam_scale` is taken;
    - a sketched layer contributes only the row and column sums of its slice of `v_hat` (O + I[+1]
      numbers): the rank-one fit of `factored_adam_scales` needs only the row means, the column means
      and the overall mean, which are sums over the shards. The large target matrices are never gathered.

    Each parameter also adds the count of elements this rank covers and a flag when it holds a nonempty
    slice without optimizer state. Under HYBRID_SHARD every element is held by R replicas and all of
    them contribute; dividing by R (count / numel) gives the same `v_hat` as one shard group. (Units
    that hold whole parameters, NO_SHARD, do not come here: their state is read as without FSDP.)
    The result is the same on every rank, and matches the unsharded `optimizer_second_moments` +
    `exact_adam_scale` / `factored_adam_scales` to float tolerance.

    Args:
        optimizer: the training optimizer (its state holds the local slices), or None.
        layers: per target, `(params, d_out, d_in, sketched)`; params are weight then optional bias.
        shards: `id(param) -> ParamShard`, from `targets.fsdp_param_shards`.
        eps: Adam's epsilon.
        all_reduce_sum: sums a tensor in place across all ranks (a collective: call on every rank).

    Returns:
        Per target `(scale_D,)` (exact) or `(s_out_O, s_in_I)` (sketched), float32, or None for a target
        when some rank lacks the second moment of a slice of it that it holds (step 0, a frozen
        parameter): the caller uses that target unpreconditioned, as in the unsharded case. The same
        on every rank.

    Raises:
        ValueError: when a target parameter is not FSDP-managed, or the gathered coverage is not a
            whole number of copies of every parameter.
    """
    state_of = optimizer.state if optimizer is not None else {}
    beta2_of = (
        {id(p): g.get("betas", (0.9, 0.999))[1] for g in optimizer.param_groups for p in g["params"]}
        if optimizer is not None
        else {}
    )
    parts: list[torch.Tensor] = []
    device = None
    for params, d_out, d_in, sketched in layers:
        payload, meta, layer_device = _local_layer_sums(params, d_out, d_in, sketched, shards, state_of, beta2_of)
        if layer_device is not None:
            device = layer_device
        parts += [payload, meta]
    flat = torch.cat(parts)
    if device is not None and device.type != "cpu":
        flat = flat.to(device)
    all_reduce_sum(flat)
    flat = flat.cpu()

    out: list[tuple[torch.Tensor, ...] | None] = []
    offset = 0
    for params, d_out, d_in, sketched in layers:
        cols = d_in + (len(params) > 1)
        width = d_out + cols if sketched else d_out * cols
        payload = flat[offset : offset + width]
        meta = flat[offset + width : offset + width + 2 * len(params)]
        offset += width + 2 * len(params)
        out.append(_layer_scales_from_sums(params, d_out, d_in, sketched, payload, meta, shards, eps))
    return out


def _local_layer_sums(
    params: Sequence[torch.nn.Parameter],
    d_out: int,
    d_in: int,
    sketched: bool,
    shards: Mapping[int, ParamShard],
    state_of: Mapping,
    beta2_of: Mapping[int, float],
) -> tuple[torch.Tensor, torch.Tensor, torch.device | None]:
    """This rank's part of one target's buffer for `sharded_adam_scales`.

    Returns:
        The float64 payload (the slice of the flattened `v_hat`, or its row and column sums when
        sketched), the per-parameter meta (covered elements, missing flag), and the device of the
        last parameter this rank holds a nonempty slice of (None when it holds none).
    """
    cols = d_in + (len(params) > 1)
    payload = torch.zeros(d_out + cols if sketched else d_out * cols, dtype=torch.float64)
    meta = torch.zeros(2 * len(params), dtype=torch.float64)  # per param: covered elements, missing flag
    device = None
    for k, p in enumerate(params):
        if id(p) not in shards:
            raise ValueError(
                f"target parameter of shape {tuple(p.shape)} is not managed by FSDP while other parameters "
                f"are; wrap the whole model (Composer does for a yaml with fsdp_config)"
            )
        shard = shards[id(p)]
        if shard.end <= shard.start:
            continue
        device = p.device
        st = state_of.get(p)
        if not st or "exp_avg_sq" not in st or id(p) not in beta2_of:
            meta[2 * k + 1] = 1.0
            continue
        v_hat = (st["exp_avg_sq"].reshape(-1).double() / (1.0 - beta2_of[id(p)] ** st.get("step", 1))).cpu()
        if v_hat.numel() != shard.end - shard.start:
            raise ValueError(
                f"optimizer state of a target parameter holds {v_hat.numel()} elements, but this rank's FSDP "
                f"shard of it spans {shard.end - shard.start}; the optimizer must be built on the FSDP model"
            )
        meta[2 * k] = float(v_hat.numel())
        flat_idx = torch.arange(shard.start, shard.end)
        # Weight element e is (row e // d_in, column e % d_in); bias element e is (row e, column d_in).
        rows, col = (flat_idx // d_in, flat_idx % d_in) if k == 0 else (flat_idx, torch.full_like(flat_idx, d_in))
        if sketched:
            payload.index_add_(0, rows, v_hat)
            payload.index_add_(0, d_out + col, v_hat)
        else:
            payload.index_add_(0, rows * cols + col, v_hat)
    return payload, meta, device


def _layer_scales_from_sums(
    params: Sequence[torch.nn.Parameter],
    d_out: int,
    d_in: int,
    sketched: bool,
    payload: torch.Tensor,
    meta: torch.Tensor,
    shards: Mapping[int, ParamShard],
    eps: float,
) -> tuple[torch.Tensor, ...] | None:
    """One target's scales from its all-reduced payload and meta: `(scale_D,)` or `(s_out_O, s_in_I)`, or None.

    Raises:
        ValueError: when the gathered coverage is not a whole number of copies of a parameter.
    """
    cols = d_in + (len(params) > 1)
    copies = []
    missing = False
    for k, p in enumerate(params):
        covered, flagged = float(meta[2 * k]), float(meta[2 * k + 1])
        numel = shards[id(p)].numel
        missing = missing or flagged > 0 or covered == 0
        # A rank without state leaves its slice uncovered: the count is then checked no further.
        if not missing and covered % numel:
            raise ValueError(
                f"FSDP shards of a target parameter ({numel} elements) cover {int(covered)} elements over all "
                f"ranks, not a whole number of copies"
            )
        copies.append(covered / numel)
    if missing:
        return None
    replicas = copies[0]
    target_device = params[0].device
    if sketched:
        row_sum_O, col_sum_I = payload[:d_out] / replicas, payload[d_out:] / replicas
        total = row_sum_O.sum()
        scales = _factored_scales(
            (row_sum_O / cols).float(), (col_sum_I / d_out).float(), (total / (d_out * cols)).float(), eps
        )
        return tuple(s.to(target_device) for s in scales)
    v_OI = (payload / replicas).float().reshape(d_out, cols)
    v_hats = [v_OI[:, :d_in]] + ([v_OI[:, d_in]] if len(params) > 1 else [])
    return (exact_adam_scale(v_hats, eps).to(target_device),)


def _factored_scales(
    row_mean_O: torch.Tensor, col_mean_I: torch.Tensor, mean: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`factored_adam_scales` from the row means, column means and overall mean of `v`."""
    root_mean = mean.clamp_min(torch.finfo(mean.dtype).tiny).sqrt()
    A_O = (row_mean_O / root_mean).sqrt()
    B_I = (col_mean_I / root_mean).sqrt()
    floor = eps**0.5
    s_out_O = (A_O + eps / (2 * B_I.mean().clamp_min(floor))).reciprocal()
    s_in_I = (B_I + eps / (2 * A_O.mean().clamp_min(floor))).reciprocal()
    return s_out_O, s_in_I


class SimulatedAdam:
    """The paper's per-example Adam-like low-pass filter (App. "Memory Efficient Gradient Computation").

    For each layer it keeps running moments `m, v` (one per feature coordinate). A call filters every
    example `i` of the pool and of the validation batch against the same pre-call state:
    `m_i = b1 m + (1-b1) g_i`, `v_i = b2 v + (1-b2) g_i^2`, feature `m_i_hat / (sqrt(v_i_hat) + eps)` with
    Adam's bias corrections `1 - b^t` (t = calls so far + 1; the paper omits them "for brevity"). With
    empty state the first call gives `g / (|g| + eps)`, i.e. sign(g). After the call (`commit`), the
    state advances with the pool mean: `m <- b1 m + (1-b1) mean_i g_i`, `v <- b2 v + (1-b2) mean_i g_i^2`
    (the average of the per-example filtered states); validation rows do not update it. In sketch
    mode the filter acts on the sketch coordinates, which stay comparable across steps because the
    projections are fixed.

    Across ranks (global-scope selection, where the gathered rows of every rank are compared in one
    problem) the state must be one: set `defer_commits` so `commit` leaves the pool sums pending,
    then call `commit_global` on every rank (or `discard` on every rank, when the step falls back):
    the state advances with the means over all ranks' pools, identically everywhere, so rank 0's
    checkpoint is every rank's state.

    Args:
        betas: (b1, b2).
        eps: added to `sqrt(v_hat)`.
    """

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.betas = betas
        self.eps = eps
        self.count = 0
        self._m: dict[str, torch.Tensor] = {}
        self._v: dict[str, torch.Tensor] = {}
        self._sum: dict[str, torch.Tensor] = {}
        self._sum_sq: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}
        self.defer_commits = False

    def filter(self, name: str, g_nD: torch.Tensor) -> torch.Tensor:
        """Filter one layer's features against the pre-call state (does not change the state).

        Args:
            name: the layer's name (state key).
            g_nD: raw features (n, D).

        Returns:
            (n, D) filtered features.

        Raises:
            ValueError: when a loaded state has a different width for this layer.
        """
        b1, b2 = self.betas
        t = self.count + 1
        m_D, v_D = self._state(name, g_nD)
        m_nD = b1 * m_D + (1 - b1) * g_nD
        v_nD = b2 * v_D + (1 - b2) * g_nD.square()
        return (m_nD / (1 - b1**t)) / ((v_nD / (1 - b2**t)).sqrt() + self.eps)

    def accumulate(self, name: str, g_nD: torch.Tensor) -> None:
        """Add pool rows to the means the next `commit` advances the state with."""
        if name in self._sum:
            self._sum[name] += g_nD.sum(dim=0)
            self._sum_sq[name] += g_nD.square().sum(dim=0)
            self._rows[name] += g_nD.shape[0]
        else:
            self._sum[name] = g_nD.sum(dim=0)
            self._sum_sq[name] = g_nD.square().sum(dim=0)
            self._rows[name] = g_nD.shape[0]

    def commit(self) -> None:
        """Advance every layer's state with the pool means accumulated since the last commit.

        With `defer_commits` set this does nothing: the sums stay pending for `commit_global`.
        """
        if not self.defer_commits:
            self._advance()

    def commit_global(self, all_reduce_sum: Callable[[torch.Tensor], None]) -> None:
        """Advance with the pool means over every rank's pending rows (a collective: call it on every rank).

        Args:
            all_reduce_sum: sums a tensor in place across ranks, e.g.
                `lambda t: dist.all_reduce(t, reduce_operation="SUM")`. One call, float64, holding every
                layer's sums, sums of squares and row counts (layers in name order).
        """
        names = sorted(self._sum)
        if names:
            parts = []
            for k in names:
                rows = self._sum[k].new_full((1,), self._rows[k])
                parts += [self._sum[k].double(), self._sum_sq[k].double(), rows.double()]
            flat = torch.cat(parts)
            all_reduce_sum(flat)
            offset = 0
            for k in names:
                width = self._sum[k].shape[0]
                dtype = self._sum[k].dtype
                self._sum[k] = flat[offset : offset + width].to(dtype)
                self._sum_sq[k] = flat[offset + width : offset + 2 * width].to(dtype)
                self._rows[k] = int(round(float(flat[offset + 2 * width])))
                offset += 2 * width + 1
        self._advance()

    def _advance(self) -> None:
        """Move the state one step with the pending pool means, then clear them."""
        b1, b2 = self.betas
        for name, total in self._sum.items():
            rows = self._rows[name]
            m_D, v_D = self._state(name, total.unsqueeze(0))
            self._m[name] = b1 * m_D + (1 - b1) * total / rows
            self._v[name] = b2 * v_D + (1 - b2) * self._sum_sq[name] / rows
        if self._sum:
            self.count += 1
        self._sum, self._sum_sq, self._rows = {}, {}, {}

    def discard(self) -> None:
        """Drop accumulated rows without updating (the call failed)."""
        self._sum, self._sum_sq, self._rows = {}, {}, {}

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The committed state as it is (`restore` puts it back; `_advance` replaces tensors, never writes into them)."""
        return self.count, dict(self._m), dict(self._v)

    def restore(self, snapshot: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:
        self.count, self._m, self._v = snapshot[0], dict(snapshot[1]), dict(snapshot[2])
        self.discard()

    def state_dict(self) -> dict:
        """Checkpointable state: the call count and per-layer moments (on CPU)."""
        return {
            "count": self.count,
            "betas": tuple(self.betas),
            "eps": self.eps,
            "m": {k: t.detach().cpu() for k, t in self._m.items()},
            "v": {k: t.detach().cpu() for k, t in self._v.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()`; tensors move to the features' device on first use.

        Raises:
            ValueError: when `state` lacks the keys `state_dict()` writes.
        """
        missing = {"count", "m", "v"} - set(state)
        if missing:
            raise ValueError(f"simulated-Adam state is missing keys {sorted(missing)}; pass a SimulatedAdam.state_dict()")
        self.count = int(state["count"])
        self._m = dict(state["m"])
        self._v = dict(state["v"])
        self.discard()

    def _state(self, name: str, g_nD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (m, v) on `g_nD`'s device and dtype, zeros when new."""
        width = g_nD.shape[1]
        if name not in self._m:
            zeros = g_nD.new_zeros(width)
            self._m[name], self._v[name] = zeros, zeros.clone()
        m_D, v_D = self._m[name], self._v[name]
        if m_D.shape[0] != width:
            raise ValueError(
                f"simulated-Adam state for layer {name!r} has {m_D.shape[0]} features but the layer now "
                f"yields {width}; the targets or sketch size changed since the state was saved"
            )
        if m_D.device != g_nD.device or m_D.dtype != g_nD.dtype:
            m_D, v_D = m_D.to(g_nD.device, g_nD.dtype), v_D.to(g_nD.device, g_nD.dtype)
            self._m[name], self._v[name] = m_D, v_D
        return m_D, v_D


def unit_rows(x_nd: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm (so `G G^T` is the cosine Gram); all-zero rows stay zero.

    Rows are first divided by their largest magnitude so tiny rows do not underflow in the norm.
    """
    tiny = torch.finfo(x_nd.dtype).tiny
    scaled_nd = x_nd / x_nd.abs().amax(dim=1, keepdim=True).clamp_min(tiny)
    return scaled_nd / scaled_nd.norm(dim=1, keepdim=True).clamp_min(tiny)
