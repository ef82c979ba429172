"""Result and registry types shared by every selection strategy, plus input and option validation."""

# Shape legend: N pool size, D feature dim, C domains, S selected count.

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

log = logging.getLogger(__name__)

__all__ = [
    "SelectionResult",
    "StrategySpec",
    "SelectionInputs",
    "NoOptions",
    "strategy",
    "validate_inputs",
    "parse_options",
    "empty_result",
    "finish_result",
    "check_finite",
    "count_domains",
    "DeferredChecks",
    "deferring_checks",
    "check_or_defer",
    "host_values",
    "SelectionNumericsError",
]


class SelectionNumericsError(ValueError):
    """The selection problem is numerically broken (non-finite inputs, a Gram block that lost definiteness).

    A ``ValueError`` for callers that only distinguish bad input; the ``DataSelection`` algorithm
    catches this type (and only this subclass of ``ValueError``) to fall back to random selection
    within capacities for the step, while bad options and shapes still stop the run.
    """


class DeferredChecks:
    """Checks of device values recorded during a selection step and judged once, from its one transfer.

    A check that reads a device value on the host (are the features finite? is the objective?)
    makes the host wait for the accelerator. Inside a `deferring_checks` block, `check_or_defer`
    records the values instead (as they are, on their device) with a judge; the caller later moves
    `packed()` to the host with everything else the step reads there, and `judge` runs the judges
    in order on those host values: the first failing one raises its error.
    """

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._judges: list[tuple[int, Callable[[list[float]], None]]] = []

    def add(self, values: torch.Tensor | Sequence[torch.Tensor], judge: Callable[[list[float]], None]) -> None:
        """Record `values` (a tensor of any shape, or several judged together in order) and the function that raises when they are bad."""
        # Kept as they are (detached only when in a graph, not to keep it alive): whoever transfers them
        # flattens and converts them, a few ops for all (`host_values`).
        parts = [values] if isinstance(values, torch.Tensor) else list(values)
        parts = [p.detach() if p.requires_grad else p for p in parts]
        self._parts += parts
        self._judges.append((sum(int(p.numel()) for p in parts), judge))

    @property
    def width(self) -> int:
        """How many numbers `packed()` holds."""
        return sum(n for n, _ in self._judges)

    def packed(self) -> list[torch.Tensor]:
        """The recorded tensors (any shape, in their dtypes), in order (for the caller's one transfer)."""
        return list(self._parts)

    def judge(self, host_values: Sequence[float]) -> None:
        """Run the judges on the transferred values (`width` numbers, in `packed()` order)."""
        offset = 0
        for n, fn in self._judges:
            fn(list(host_values[offset : offset + n]))
            offset += n


_DEFERRED: contextvars.ContextVar[DeferredChecks | None] = contextvars.ContextVar("selection_deferred_checks", default=None)


@contextlib.contextmanager
def deferring_checks(checks: DeferredChecks) -> Iterator[DeferredChecks]:
    """Within the block, `check_or_defer` records into `checks` instead of reading device values."""
    token = _DEFERRED.set(checks)
    try:
        yield checks
    finally:
        _DEFERRED.reset(token)


def check_or_defer(values: torch.Tensor | Sequence[torch.Tensor], judge: Callable[[list[float]], None]) -> None:
    """Judge `values` (a tensor, or several in order) now (one host sync), or record them when a `deferring_checks` block is open."""
    checks = _DEFERRED.get()
    if checks is not None:
        checks.add(values, judge)
    else:
        parts = [values] if isinstance(values, torch.Tensor) else list(values)
        judge([v for part in host_values(parts) for v in part])


def host_values(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """Each tensor's numbers (flattened, in order) as Python floats, read in one transfer per device.

    Float64 on the way: exact for integers below 2**53 and for float32/float64 values. A tensor
    given twice (the same object) travels once. Per device the tensors are grouped by dtype: a
    group's 0-dim tensors are stacked, the group concatenated and converted to float64 once, the
    groups concatenated and the result read with one `tolist` (a few kernels for any number of
    tensors, none per tensor; nothing to detach under `no_grad`).
    """
    by_device: dict[torch.device, dict[torch.dtype, dict[int, torch.Tensor]]] = {}
    for t in tensors:
        by_device.setdefault(t.device, {}).setdefault(t.dtype, {})[id(t)] = t
    read: dict[int, list[float]] = {}
    with torch.no_grad():
        for groups in by_device.values():
            order: list[torch.Tensor] = []
            pieces = []
            for members in groups.values():
                rows = [t for t in members.values() if t.dim() > 0]
                scalars = [t for t in members.values() if t.dim() == 0]
                parts = [t if t.dim() == 1 else t.reshape(-1) for t in rows]
                if scalars:
                    parts.append(torch.stack(scalars) if len(scalars) > 1 else scalars[0].reshape(1))
                order += rows + scalars
                pieces.append((torch.cat(parts) if len(parts) > 1 else parts[0]).to(torch.float64))
            flat = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).tolist()
            offset = 0
            for t in order:
                read[id(t)] = flat[offset : offset + t.numel()]
                offset += t.numel()
    return [read[id(t)] for t in tensors]


@dataclass
class SelectionResult:
    """What a selection strategy returns.

    Attributes:
        indices: ``(k,)`` int64, distinct pool positions sorted ascending, on the input device;
            ``k = min(kappa, n)``.
        domain_counts: ``(C,)`` int64, how many selected examples each domain contributes.
        weights: ``(k,)`` refit weights aligned with ``indices`` in the ORIGINAL variable ``w``
            of ``U(w) = <w, mu> - (eta/2) w^T K w`` (``w = v / eta``; the solvers work in
            ``v = eta * w``). At ``eta == 0`` ``U`` is unbounded, so the scale-free ``v`` is
            reported instead and ``info["scale_free"]`` is true. ``None`` for strategies
            without weights.
        objective: 0-dim tensor: ``f(S) = U(w*)`` for ``partitionsel`` and ``iwd`` (``eta * f(S)``
            at ``eta == 0``); the strategy's own score otherwise (see each strategy's
            docstring); ``None`` for the random baselines.
        info: extra values worth logging: 0-dim tensors computed on the device (e.g. the
            objective's scale-free form), or Python numbers the solver counted on the host (e.g.
            the number of swaps made), which cost no transfer.
    """

    indices: torch.Tensor
    domain_counts: torch.Tensor
    weights: torch.Tensor | None = None
    objective: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StrategySpec:
    """A registry entry: the strategy function and what it needs from the caller.

    Attributes:
        fn: the keyword-only strategy function (see ``composer_algos.selection``).
        needs_features: needs per-example gradient features ``G`` (or their Gram).
        needs_validation: needs the validation feature ``gbar``.
        uses_capacities: respects per-domain capacities.
        options: the dataclass of the strategy's options (its fields are the allowed names, its
            ``__post_init__`` checks the values); default: the one ``@strategy`` recorded on ``fn``,
            else ``NoOptions``.
        needs_validation_rows: needs the validation examples' features one by one (``val_rows``,
            ``(V, D)``; facloc and uniprot use them as anchors), not only their mean; default: what
            ``@strategy`` recorded on ``fn``, else False.
    """

    fn: Callable[..., SelectionResult]
    needs_features: bool
    needs_validation: bool
    uses_capacities: bool
    options: type | None = None
    needs_validation_rows: bool | None = None

    def __post_init__(self) -> None:
        if self.options is None:  # the @strategy decorator records the option dataclass on the function
            object.__setattr__(self, "options", getattr(self.fn, "options", NoOptions))
        if self.needs_validation_rows is None:
            object.__setattr__(self, "needs_validation_rows", bool(getattr(self.fn, "needs_validation_rows", False)))


@dataclass(frozen=True)
class SelectionInputs:
    """Validated, normalised inputs of one selection call.

    Attributes:
        n: pool size.
        k: number of examples to select, ``min(kappa, n)``.
        device: where the outputs live (the device of ``features``, ``gram`` or ``domain_ids``).
        dtype: the float dtype the solvers compute in (float32 for half-precision features).
        domain_ids: ``(N,)`` int64 on ``device``.
        features: ``(N, D)`` on ``device`` in ``dtype``, or None.
        val_feature: ``(D,)`` on ``device`` in ``dtype``, or None.
        gram: ``(N, N)`` on ``device`` in ``dtype``, or None.
        capacities: ``(C,)`` int64 on ``device``, or None.
        eta: the learning rate as a Python float.
        strategy: the strategy name, for error messages.
        num_domains: ``C``.
        val_rows: ``(V, D)`` validation features on ``device`` in ``dtype`` (strategies with
            ``needs_validation_rows``), or None.
        domain_ids_host: ``(N,)`` int64 domain ids on the host when the caller gave host ids (the
            training loop's), else None: host-side bookkeeping reads them without a sync.
        domain_counts_host: ``(C,)`` int64 pool count per domain on the host, with ``domain_ids_host``.
        capacities_host: ``capacities`` as the caller gave them on the host (int64), or None.
    """

    n: int
    k: int
    device: torch.device
    dtype: torch.dtype
    domain_ids: torch.Tensor
    features: torch.Tensor | None
    val_feature: torch.Tensor | None
    gram: torch.Tensor | None
    capacities: torch.Tensor | None
    eta: float
    strategy: str = ""
    num_domains: int = 0
    val_rows: torch.Tensor | None = None
    domain_ids_host: torch.Tensor | None = None
    domain_counts_host: torch.Tensor | None = None
    capacities_host: torch.Tensor | None = None

    def resolve_capacities(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """``capacities.resolve_capacities`` for this pool, on the host when the ids and capacities came from there.

        Returns:
            ``(C,)`` int64 capacities (on the host when computed there; strategies move them).
        """
        from composer_algos.selection.capacities import resolve_capacities

        host = self.domain_counts_host is not None and (self.capacities is None or self.capacities_host is not None)
        return resolve_capacities(
            self.strategy,
            self.capacities_host if host and self.capacities is not None else self.capacities,
            self.domain_ids,
            self.num_domains,
            self.k,
            generator,
            counts_C=self.domain_counts_host if host else None,
        )

    def finish(
        self,
        indices_S: torch.Tensor,
        *,
        weights_S: torch.Tensor | None = None,
        objective: torch.Tensor | None = None,
        info: dict[str, torch.Tensor | int | float] | None = None,
    ) -> SelectionResult:
        """The result for the selected pool positions (``finish_result`` with this pool's domains)."""
        return finish_result(
            indices_S, self.domain_ids, self.num_domains, weights_S=weights_S, objective=objective, info=info
        )

    def check_finite(self, **tensors: torch.Tensor) -> None:
        """``check_finite`` under this strategy's name."""
        check_finite(self.strategy, **tensors)


@dataclass(frozen=True, kw_only=True)
class NoOptions:
    """The options of a strategy that takes none."""


class _StrategyBody(Protocol):
    def __call__(
        self, inputs: SelectionInputs, opts: Any, *, num_domains: int, generator: torch.Generator | None
    ) -> SelectionResult: ...


def strategy(
    name: str,
    *,
    options: type = NoOptions,
    needs_features: bool,
    needs_validation: bool,
    gram_suffices: bool = False,
    weighted: bool = False,
    needs_validation_rows: bool = False,
) -> Callable[[_StrategyBody], Callable[..., SelectionResult]]:
    """Give a strategy body the registry signature and the one shared prologue.

    The decorated function has the keyword-only signature of every strategy::

        fn(*, features, val_feature, domain_ids, num_domains, kappa, eta, generator,
           capacities=None, gram=None, val_rows=None, **options) -> SelectionResult

    It parses ``options`` into the ``options`` dataclass (unknown names raise), validates the inputs
    (``validate_inputs``), answers ``kappa == 0`` or an empty pool with an empty result, and
    otherwise calls ``body(inputs, opts, num_domains=..., generator=...)``. A strategy that needs no
    validation feature never sees (or checks) one. A strategy that needs no features does not check
    them either (only their device is used), so it stays a usable fallback when they are broken.

    The arguments of the decorated function, common to every strategy: ``features`` ``(N, D)``
    per-example gradient features ``G``; ``val_feature`` ``(D,)`` validation feature ``gbar``;
    ``domain_ids`` ``(N,)`` domain of each example in ``[0, num_domains)``; ``num_domains`` ``C``;
    ``kappa`` the budget (``min(kappa, n)`` examples are selected); ``eta`` the optimizer's current
    learning rate (>= 0); ``generator`` the step's randomness (strategies without randomness never
    touch it); ``capacities`` ``(C,)`` per-domain capacities (proportional ones when None, for the
    strategies that use capacities); ``gram`` an optional precomputed ``(N, N)`` ``G G^T``;
    ``val_rows`` the ``(V, D)`` validation features one by one (read only with
    ``needs_validation_rows``); ``**options`` the fields of the strategy's option dataclass.

    Args:
        name: the strategy name, used in error messages.
        options: the option dataclass (``NoOptions`` by default).
        needs_features: whether ``features`` (or ``gram`` if ``gram_suffices``) is required and read.
        needs_validation: whether ``val_feature`` is required.
        gram_suffices: whether ``gram`` can stand in for ``features``.
        weighted: whether an empty result carries (empty) weights and a zero objective.
        needs_validation_rows: whether ``val_rows`` is required and read.

    Returns:
        The decorator.
    """

    def decorate(body: _StrategyBody) -> Callable[..., SelectionResult]:
        def fn(
            *,
            features: torch.Tensor | None,
            val_feature: torch.Tensor | None,
            domain_ids: torch.Tensor,
            num_domains: int,
            kappa: int,
            eta: float,
            generator: torch.Generator | None,
            capacities: torch.Tensor | None = None,
            gram: torch.Tensor | None = None,
            val_rows: torch.Tensor | None = None,
            **option_values: Any,
        ) -> SelectionResult:
            opts = parse_options(name, options, option_values)
            inputs = _strategy_inputs(
                name, needs_features, needs_validation, gram_suffices, needs_validation_rows,
                features=features, val_feature=val_feature, domain_ids=domain_ids, num_domains=num_domains,
                kappa=kappa, eta=eta, capacities=capacities, gram=gram, val_rows=val_rows,
            )
            if inputs.k == 0:
                return empty_result(inputs, num_domains, with_weights=weighted)
            return body(inputs, opts, num_domains=num_domains, generator=generator)

        fn.__name__ = getattr(body, "__name__", name)
        fn.__qualname__ = getattr(body, "__qualname__", name)
        fn.__doc__ = body.__doc__
        fn.__module__ = body.__module__
        fn.options = options  # type: ignore[attr-defined]  # read by StrategySpec and the config
        fn.needs_validation_rows = needs_validation_rows  # type: ignore[attr-defined]  # read by StrategySpec
        return fn

    return decorate


def _strategy_inputs(
    name: str,
    needs_features: bool,
    needs_validation: bool,
    gram_suffices: bool,
    needs_validation_rows: bool,
    *,
    features: torch.Tensor | None,
    val_feature: torch.Tensor | None,
    domain_ids: torch.Tensor,
    val_rows: torch.Tensor | None,
    gram: torch.Tensor | None,
    **rest: Any,
) -> SelectionInputs:
    """The prologue of a `strategy` call: what the strategy does not read is dropped, the rest validated."""
    if not needs_features:
        # The features only fix the output device.
        anchor = features if features is not None else gram
        if anchor is not None and isinstance(domain_ids, torch.Tensor):
            domain_ids = domain_ids.to(anchor.device)
        features = gram = None
    return validate_inputs(
        name,
        features=features,
        val_feature=val_feature if needs_validation else None,
        domain_ids=domain_ids,
        gram=gram,
        needs_features=needs_features,
        needs_validation=needs_validation,
        gram_suffices=gram_suffices,
        val_rows=val_rows if needs_validation_rows else None,
        needs_validation_rows=needs_validation_rows,
        **rest,
    )


def validate_inputs(
    strategy: str,
    *,
    features: torch.Tensor | None,
    val_feature: torch.Tensor | None,
    domain_ids: torch.Tensor,
    num_domains: int,
    kappa: int,
    eta: float,
    capacities: torch.Tensor | None,
    gram: torch.Tensor | None,
    needs_features: bool,
    needs_validation: bool,
    gram_suffices: bool = False,
    val_rows: torch.Tensor | None = None,
    needs_validation_rows: bool = False,
) -> SelectionInputs:
    """Check the common arguments of a strategy call and move them to one device and dtype.

    ``domain_ids`` and ``capacities`` follow the features to their device; half-precision
    features are upcast to float32 (Cholesky and the solvers need it). Costs one host sync for
    the domain-id range check when the ids live on an accelerator; host ids (the training loop's)
    are checked and counted on the host and moved without blocking. Finiteness is checked later and more cheaply by the strategies
    (``check_finite`` on ``diag(K)`` and ``G gbar``, which are NaN/inf whenever a row of ``G`` is).

    Args:
        strategy: the strategy name, used in error messages.
        features: ``(N, D)`` per-example features or None.
        val_feature: ``(D,)`` validation feature or None.
        domain_ids: ``(N,)`` integer domain of each pool example.
        num_domains: the number of domains ``C`` (>= 1).
        kappa: the budget (>= 0).
        eta: the learning rate (finite, >= 0).
        capacities: ``(C,)`` per-domain capacities or None.
        gram: ``(N, N)`` precomputed ``G G^T`` or None.
        needs_features: whether ``features`` (or ``gram`` if ``gram_suffices``) is required.
        needs_validation: whether ``val_feature`` is required.
        gram_suffices: whether ``gram`` can stand in for ``features``.
        val_rows: ``(V, D)`` validation features or None.
        needs_validation_rows: whether ``val_rows`` is required.

    Returns:
        The validated inputs.

    Raises:
        ValueError: naming the first bad argument, its value and what is allowed.
    """
    eta_f = _checked_scalars(strategy, num_domains, kappa, eta)
    if not isinstance(domain_ids, torch.Tensor) or domain_ids.dim() != 1:
        raise ValueError(f"{strategy}: `domain_ids` must be a 1-D integer tensor, got {_describe(domain_ids)}")
    if domain_ids.dtype.is_floating_point or domain_ids.dtype == torch.bool or domain_ids.is_complex():
        raise ValueError(f"{strategy}: `domain_ids` must have an integer dtype, got {domain_ids.dtype}")
    n = domain_ids.shape[0]
    _check_feature_shapes(strategy, n, features, gram, needs_features, gram_suffices)
    _check_validation_shapes(strategy, features, val_feature, val_rows, needs_validation, needs_validation_rows)

    return _placed_inputs(
        strategy, n, kappa, eta_f, num_domains, domain_ids, features, val_feature, val_rows, gram, capacities
    )


def _placed_inputs(
    strategy: str,
    n: int,
    kappa: int,
    eta: float,
    num_domains: int,
    domain_ids: torch.Tensor,
    features: torch.Tensor | None,
    val_feature: torch.Tensor | None,
    val_rows: torch.Tensor | None,
    gram: torch.Tensor | None,
    capacities: Any,
) -> SelectionInputs:
    """The checked inputs on the features' device and dtype (float32 for half precision), ids in range."""
    anchor = features if features is not None else gram
    device = anchor.device if anchor is not None else domain_ids.device
    src_dtype = anchor.dtype if anchor is not None else torch.float32
    dtype = src_dtype if src_dtype in (torch.float32, torch.float64) else torch.float32

    ids_host = counts_host = capacities_host = cap_min = None
    if capacities is not None:
        _check_capacities_type(strategy, capacities, num_domains)
    # The capacities' minimum is read with the ids' range when they live together (the step's: on the host).
    with_caps = capacities is not None and capacities.device == domain_ids.device
    if n > 0:
        # One sync when the ids live on an accelerator; none for host ids (the training loop's).
        bounds = torch.stack([*torch.aminmax(domain_ids), *([capacities.min()] if with_caps else [])]).tolist()
        if bounds[0] < 0 or bounds[1] >= num_domains:
            raise ValueError(
                f"{strategy}: `domain_ids` must lie in [0, num_domains={num_domains}), "
                f"got values in [{bounds[0]}, {bounds[1]}]"
            )
        cap_min = bounds[2] if with_caps else None
    if domain_ids.device.type == "cpu":
        ids_host = domain_ids.long()
        counts_host = torch.bincount(ids_host, minlength=num_domains)
    # Host ids (the loader's) travel without making the host wait.
    domain_ids = domain_ids.to(device=device, dtype=torch.long, non_blocking=True)
    if features is not None:
        features = features.to(device=device, dtype=dtype)
    if val_feature is not None:
        val_feature = val_feature.to(device=device, dtype=dtype)
    if val_rows is not None:
        val_rows = val_rows.to(device=device, dtype=dtype)
    if gram is not None:
        gram = gram.to(device=device, dtype=dtype)
        # A caller-supplied Gram is scanned in full: its off-diagonal entries are not implied by its
        # diagonal (as they are for G G^T, by Cauchy-Schwarz), so a NaN there would pass the
        # strategies' cheap check of diag(K).
        check_finite(strategy, gram=gram)
    if capacities is not None:
        capacities, capacities_host = _checked_capacities(strategy, capacities, device, cap_min)
    return SelectionInputs(
        n=n,
        k=min(kappa, n),
        device=device,
        dtype=dtype,
        domain_ids=domain_ids,
        features=features,
        val_feature=val_feature,
        gram=gram,
        capacities=capacities,
        eta=eta,
        strategy=strategy,
        num_domains=num_domains,
        val_rows=val_rows,
        domain_ids_host=ids_host,
        domain_counts_host=counts_host,
        capacities_host=capacities_host,
    )


def _checked_scalars(strategy: str, num_domains: Any, kappa: Any, eta: Any) -> float:
    """Check ``num_domains``, ``kappa`` and ``eta``; returns ``eta`` as a float."""
    if isinstance(num_domains, bool) or not isinstance(num_domains, int) or num_domains < 1:
        raise ValueError(f"{strategy}: `num_domains` must be an int >= 1, got {num_domains!r}")
    if isinstance(kappa, bool) or not isinstance(kappa, int) or kappa < 0:
        raise ValueError(f"{strategy}: `kappa` must be an int >= 0, got {kappa!r}")
    try:
        eta_f = float(eta)
    except (TypeError, ValueError):
        raise ValueError(f"{strategy}: `eta` must be a finite float >= 0, got {eta!r}") from None
    if not math.isfinite(eta_f) or eta_f < 0:
        raise ValueError(f"{strategy}: `eta` must be a finite float >= 0, got {eta!r}")
    return eta_f


def _check_feature_shapes(
    strategy: str,
    n: int,
    features: torch.Tensor | None,
    gram: torch.Tensor | None,
    needs_features: bool,
    gram_suffices: bool,
) -> None:
    """``features`` (N, D) and ``gram`` (N, N) floating, and present when the strategy needs them."""
    if features is not None:
        if not isinstance(features, torch.Tensor) or features.dim() != 2 or features.shape[0] != n:
            raise ValueError(
                f"{strategy}: `features` must be a ({n}, D) floating tensor matching `domain_ids`, "
                f"got {_describe(features)}"
            )
        if not features.dtype.is_floating_point:
            raise ValueError(f"{strategy}: `features` must be floating point, got {features.dtype}")
    if gram is not None:
        if not isinstance(gram, torch.Tensor) or gram.shape != (n, n) or not gram.dtype.is_floating_point:
            raise ValueError(f"{strategy}: `gram` must be a floating ({n}, {n}) tensor, got {_describe(gram)}")
    if needs_features and features is None and not (gram_suffices and gram is not None):
        need = "`features` (or `gram`)" if gram_suffices else "`features`"
        raise ValueError(f"{strategy}: needs {need}, got None")


def _check_validation_shapes(
    strategy: str,
    features: torch.Tensor | None,
    val_feature: torch.Tensor | None,
    val_rows: torch.Tensor | None,
    needs_validation: bool,
    needs_validation_rows: bool,
) -> None:
    """``val_feature`` (D,) and ``val_rows`` (V, D) floating, and present when the strategy needs them."""
    dim = features.shape[1] if features is not None else None
    if val_feature is not None:
        if (
            not isinstance(val_feature, torch.Tensor)
            or val_feature.dim() != 1
            or not val_feature.dtype.is_floating_point
            or (dim is not None and val_feature.shape[0] != dim)
        ):
            raise ValueError(
                f"{strategy}: `val_feature` must be a 1-D floating tensor of length D={dim}, "
                f"got {_describe(val_feature)}"
            )
    if needs_validation and val_feature is None:
        raise ValueError(f"{strategy}: needs `val_feature` (the validation gradient feature), got None")
    if val_rows is not None:
        if (
            not isinstance(val_rows, torch.Tensor)
            or val_rows.dim() != 2
            or val_rows.shape[0] < 1
            or not val_rows.dtype.is_floating_point
            or (dim is not None and val_rows.shape[1] != dim)
        ):
            raise ValueError(
                f"{strategy}: `val_rows` must be a floating (V >= 1, D={dim}) tensor of validation features, "
                f"got {_describe(val_rows)}"
            )
    if needs_validation_rows and val_rows is None:
        raise ValueError(f"{strategy}: needs `val_rows` (the validation examples' features, (V, D)), got None")


def _check_capacities_type(strategy: str, capacities: Any, num_domains: int) -> None:
    """``capacities`` is an integer tensor of shape ``(C,)``."""
    if (
        not isinstance(capacities, torch.Tensor)
        or capacities.shape != (num_domains,)
        or capacities.dtype.is_floating_point
        or capacities.dtype == torch.bool
    ):
        raise ValueError(
            f"{strategy}: `capacities` must be an integer tensor of shape ({num_domains},), "
            f"got {_describe(capacities)}"
        )


def _checked_capacities(
    strategy: str, capacities: torch.Tensor, device: torch.device, minimum: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``capacities`` (type already checked) checked >= 0 where they are (host capacities, the step's, cost no sync), then on ``device``.

    ``minimum``: their smallest value when the caller read it already (with the ids' range).
    Returns the capacities on the device and the host copy (None when they came from a device).
    """
    if minimum is None:
        minimum = int(capacities.min())  # C >= 1 (checked before)
    if minimum < 0:
        raise ValueError(f"{strategy}: `capacities` must be >= 0, got {capacities.tolist()}")
    capacities_host = capacities.long() if capacities.device.type == "cpu" else None
    return capacities.to(device=device, dtype=torch.long, non_blocking=True), capacities_host


_OptionsT = TypeVar("_OptionsT")


def parse_options(strategy: str, options_cls: type[_OptionsT], options: Mapping[str, Any]) -> _OptionsT:
    """Build a strategy's option dataclass, rejecting unknown option names.

    Args:
        strategy: the strategy name, used in error messages.
        options_cls: a dataclass whose ``__post_init__`` validates the values.
        options: the extra keyword arguments the caller gave.

    Returns:
        The options instance.

    Raises:
        ValueError: for unknown option names (listing the allowed ones) or bad values.
    """
    allowed = [f.name for f in dataclasses.fields(options_cls)]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"{strategy}: unknown option(s) {unknown}; allowed options are {allowed or 'none'}"
        )
    return options_cls(**options)


def empty_result(inputs: SelectionInputs, num_domains: int, *, with_weights: bool) -> SelectionResult:
    """The result of selecting nothing (``kappa == 0`` or an empty pool)."""
    device = inputs.device
    return SelectionResult(
        indices=torch.zeros(0, dtype=torch.long, device=device),
        domain_counts=torch.zeros(num_domains, dtype=torch.long, device=device),
        weights=torch.zeros(0, dtype=inputs.dtype, device=device) if with_weights else None,
        objective=torch.zeros((), dtype=inputs.dtype, device=device) if with_weights else None,
    )


def finish_result(
    indices_S: torch.Tensor,
    domain_ids_N: torch.Tensor,
    num_domains: int,
    *,
    weights_S: torch.Tensor | None = None,
    objective: torch.Tensor | None = None,
    info: dict[str, torch.Tensor | int | float] | None = None,
) -> SelectionResult:
    """Sort the selection ascending (weights follow) and count it per domain."""
    indices_S, order_S = torch.sort(indices_S)  # the sorted values and their order in one op
    if weights_S is not None:
        weights_S = weights_S[order_S]
    counts_C = count_domains(domain_ids_N.index_select(0, indices_S), num_domains)
    return SelectionResult(
        indices=indices_S,
        domain_counts=counts_C,
        weights=weights_S,
        objective=objective,
        info=dict(info or {}),
    )


def count_domains(domain_ids: torch.Tensor, num_domains: int) -> torch.Tensor:
    """``(C,)`` int64 count of each domain id, without a host sync on an accelerator.

    ``torch.bincount`` on CUDA reads the largest id on the host to size its output; a scatter into
    ``C`` slots does not. Ids must lie in ``[0, C)``.
    """
    ids = domain_ids.long()
    return torch.zeros(num_domains, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def check_finite(strategy: str, **tensors: torch.Tensor) -> None:
    """Raise when any of the named tensors holds NaN or inf (one host sync, or deferred to the step's one).

    Strategies pass cheap derived quantities (``diag(K)``, ``G gbar``): a NaN or inf anywhere in a
    row of ``G`` makes that row's diagonal Gram entry non-finite, so the full ``(N, D)`` features
    need not be scanned. Inside a `deferring_checks` block the check is recorded and raised when
    the block's owner judges it (the selection step does, after its one transfer).

    Raises:
        SelectionNumericsError: naming the non-finite tensors.
    """
    # Integer and bool tensors are finite by construction.
    names = [
        name for name, t in tensors.items()
        if t is not None and t.numel() > 0 and (t.is_floating_point() or t.is_complex())
    ]
    if not names:
        return

    def judge(largest: list[float]) -> None:
        bad = [name for name, m in zip(names, largest) if not math.isfinite(m)]
        if bad:
            raise SelectionNumericsError(
                f"{strategy}: non-finite values (NaN/inf) in {bad}; the gradient features or the validation "
                "feature are broken (fall back to `random` for this step)"
            )

    # One reduction per tensor: its largest |value| is finite exactly when all its values are (a NaN propagates).
    check_or_defer([torch.linalg.vector_norm(tensors[name], float("inf")) for name in names], judge)


def _describe(x: object) -> str:
    """A short description of a bad argument for error messages."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return repr(x)
