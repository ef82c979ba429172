"""Read and write domain-mixture files: `mixture.json` (the final mixture) and `mixture_steps.csv`."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "MixtureFile",
    "MixtureCSVWriter",
    "write_mixture_json",
    "read_mixture_json",
    "read_mixture_csv",
    "stream_weights",
]

FORMAT_VERSION = 1

# Sums within this distance of 1 are accepted as they are; within _RENORM_TOL they are
# renormalised with a warning (float32 accumulation over many steps drifts this far);
# anything further is a bug upstream and raises.
_SUM_TOL = 1e-6
_RENORM_TOL = 1e-3
_RESERVED_KEYS = frozenset({"format_version", "method", "domains", "weights", "steps", "natural"})


@dataclass
class MixtureFile:
    """The parsed contents of a `mixture.json`.

    Attributes:
        method: The method that produced the mixture (e.g. "doremi", "partitionsel").
        domain_names: Domain names in file order.
        weights: Domain name -> weight; the weights sum to 1.
        steps: Number of training steps the mixture summarises.
        natural: Domain name -> natural share of the data, or None when unknown.
        extra: Any further top-level keys, unchanged.
    """

    method: str
    domain_names: list[str]
    weights: dict[str, float]
    steps: int
    natural: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def weights_list(self, domain_names: Sequence[str] | None = None) -> list[float]:
        """Weights as a list in the order of `domain_names` (default: file order).

        Raises:
            ValueError: If a requested domain is not in the file.
        """
        names = list(self.domain_names if domain_names is None else domain_names)
        missing = [n for n in names if n not in self.weights]
        if missing:
            raise ValueError(
                f"mixture file (method {self.method!r}) has no weight for domains {missing}; "
                f"it covers {self.domain_names}"
            )
        return [self.weights[n] for n in names]


def write_mixture_json(
    path: str | os.PathLike,
    *,
    method: str,
    domain_names: list[str],
    weights: Sequence[float] | torch.Tensor,
    steps: int,
    natural: Sequence[float] | torch.Tensor | None = None,
    extra: dict | None = None,
) -> None:
    """Write a domain mixture as `mixture.json` (format version 1).

    The file is `{"format_version": 1, "method": ..., "domains": [...], "weights": {name: w},
    "steps": N, "natural": {name: p} | null, **extra}`. It is written to a temporary file and
    renamed, so a reader never sees a half-written file.

    Args:
        path: Output file; parent directories are created.
        method: Name of the producing method.
        domain_names: Unique domain names, in the order of `weights`.
        weights: One non-negative finite weight per domain, summing to 1 (sums within 1e-3 of 1
            are renormalised with a warning).
        steps: Number of training steps the mixture summarises (>= 0).
        natural: Optional natural shares of the data, same rules as `weights`.
        extra: Optional extra top-level keys (must be JSON-serialisable and not clash with the
            reserved keys).

    Raises:
        ValueError: If names are not unique, lengths differ, a weight is negative or not finite,
            the sum is not 1, `steps` is negative, or `extra` uses a reserved key.
    """
    path = Path(path)
    names = _check_names(domain_names, where=str(path))
    w = _check_weights(weights, len(names), where=f"{path}: weights")
    nat = None if natural is None else _check_weights(natural, len(names), where=f"{path}: natural")
    if int(steps) < 0:
        raise ValueError(f"{path}: `steps` must be >= 0, got {steps}")
    extra = dict(extra or {})
    clash = sorted(_RESERVED_KEYS & set(extra))
    if clash:
        raise ValueError(f"{path}: `extra` may not use reserved keys {clash}; rename them")
    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "method": str(method),
        "domains": names,
        "weights": dict(zip(names, w, strict=True)),
        "steps": int(steps),
        "natural": None if nat is None else dict(zip(names, nat, strict=True)),
    }
    doc.update(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_mixture_json(path: str | os.PathLike) -> MixtureFile:
    """Read a `mixture.json` written by `write_mixture_json`.

    Args:
        path: The file.

    Returns:
        The parsed `MixtureFile`.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If it is not valid JSON, has an unknown format version, or a field is missing
            or invalid (the message names the file and the field).
    """
    path = Path(path)
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object at top level, got {type(doc).__name__}")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: `format_version` must be {FORMAT_VERSION}, got {version!r}")
    for key in ("method", "domains", "weights", "steps"):
        if key not in doc:
            raise ValueError(f"{path}: missing required field `{key}`")
    if not isinstance(doc["method"], str):
        raise ValueError(f"{path}: `method` must be a string, got {doc['method']!r}")
    if not isinstance(doc["domains"], list) or not all(isinstance(n, str) for n in doc["domains"]):
        raise ValueError(f"{path}: `domains` must be a list of strings, got {doc['domains']!r}")
    names = _check_names(doc["domains"], where=str(path))
    weights = _read_weight_map(doc["weights"], names, where=f"{path}: `weights`")
    steps = doc["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"{path}: `steps` must be a non-negative integer, got {steps!r}")
    natural = doc.get("natural")
    if natural is not None:
        natural = _read_weight_map(natural, names, where=f"{path}: `natural`")
    extra = {k: v for k, v in doc.items() if k not in _RESERVED_KEYS}
    return MixtureFile(
        method=doc["method"], domain_names=names, weights=weights, steps=steps, natural=natural, extra=extra
    )


class MixtureCSVWriter:
    """Appends per-step mixtures to a CSV with header `step,<domain_1>,...,<domain_C>`.

    Each row is flushed so that a crashed run keeps every step written so far.

    Args:
        path: The CSV file; parent directories are created.
        domain_names: Unique domain names (the column order).
        resume: If True and the file exists with the same header, append to it; rows with a step
            >= the first step written after resuming are dropped first (they belong to the
            interrupted part of the previous run). If False, the file is truncated.

    Raises:
        ValueError: If names are not unique, or `resume` finds a file with a different header.
    """

    def __init__(self, path: str | os.PathLike, domain_names: list[str], resume: bool = False) -> None:
        self.path = Path(path)
        self.domain_names = _check_names(domain_names, where=str(self.path))
        self._header = ["step", *self.domain_names]
        self._pending_truncate = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, newline="") as f:
                header = next(csv.reader(f), None)
            if header != self._header:
                raise ValueError(
                    f"{self.path}: cannot resume, header {header} differs from {self._header}; "
                    "delete the file or resume with the same domains"
                )
            self._pending_truncate = True
            self._file = open(self.path, "a", newline="")
        else:
            self._file = open(self.path, "w", newline="")
            csv.writer(self._file).writerow(self._header)
            self._file.flush()
        self._writer = csv.writer(self._file)

    def write(self, step: int, weights: Sequence[float] | torch.Tensor) -> None:
        """Append one row (`weights` in the constructor's domain order).

        Raises:
            ValueError: If the number of weights is wrong or a weight is not finite.
        """
        w = _to_float_list(weights)
        if len(w) != len(self.domain_names):
            raise ValueError(
                f"{self.path}: got {len(w)} weights for {len(self.domain_names)} domains {self.domain_names}"
            )
        if not all(math.isfinite(x) for x in w):
            raise ValueError(f"{self.path}: weights at step {step} must be finite, got {w}")
        if self._pending_truncate:
            self._drop_rows_from(int(step))
            self._pending_truncate = False
        self._writer.writerow([int(step), *(repr(x) for x in w)])
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> MixtureCSVWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drop_rows_from(self, step: int) -> None:
        self._file.close()
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))
        kept = [rows[0]] + [r for r in rows[1:] if r and int(r[0]) < step]
        with open(self.path, "w", newline="") as f:
            csv.writer(f).writerows(kept)
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)


def stream_weights(
    domain_weights: Mapping[str, float] | None, domain_weights_file: str | None, *, where: str
) -> dict[str, float] | None:
    """The training streams' proportions: `domain_weights`, or the weights of a `mixture.json` file.

    Args:
        domain_weights: proportions by domain name (None: the natural mixture, unless a file is given).
        domain_weights_file: a `mixture.json` (DoReMi's or a selection run's) whose weights replace them.
        where: the yaml path of the dataset section, used in messages (`train_loader.dataset`).

    Raises:
        FileNotFoundError: `domain_weights_file` does not exist.
    """
    if domain_weights_file is None:
        return None if domain_weights is None else dict(domain_weights)
    if not os.path.isfile(domain_weights_file):
        raise FileNotFoundError(
            f"{where}.domain_weights_file: no such file {domain_weights_file!r} "
            "(for DoReMi's stage c, run the proxy stage first; it writes <run_dir>/doremi/mixture.json)"
        )
    weights = dict(read_mixture_json(domain_weights_file).weights)
    log.info("stream proportions from %s: %s", domain_weights_file, weights)
    return weights


def read_mixture_csv(path: str | os.PathLike) -> tuple[list[int], list[str], np.ndarray]:
    """Read a CSV written by `MixtureCSVWriter`.

    Args:
        path: The CSV file.

    Returns:
        `(steps, domain_names, weights_SC)`: the step of each row, the domain names, and a float64
        array of shape (S, C), one row per step.

    Raises:
        ValueError: If the header does not start with `step`, or a row is malformed (the message
            names the file and the line).
    """
    path = Path(path)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or not rows[0] or rows[0][0] != "step":
        raise ValueError(f"{path}: first line must be the header `step,<domain_1>,...`, got {rows[:1]}")
    names = _check_names(rows[0][1:], where=str(path))
    steps: list[int] = []
    values: list[list[float]] = []
    for lineno, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(names) + 1:
            raise ValueError(f"{path}: line {lineno} has {len(row)} fields, expected {len(names) + 1}")
        try:
            steps.append(int(row[0]))
            values.append([float(x) for x in row[1:]])
        except ValueError as e:
            raise ValueError(f"{path}: line {lineno} is not numeric ({e})") from e
    weights_SC = np.asarray(values, dtype=np.float64).reshape(len(values), len(names))
    return steps, names, weights_SC


def _check_names(domain_names: Sequence[str], *, where: str) -> list[str]:
    names = [str(n) for n in domain_names]
    if not names:
        raise ValueError(f"{where}: `domains` must not be empty")
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"{where}: domain names must be unique, got duplicates {dups}")
    return names


def _to_float_list(values: Sequence[float] | torch.Tensor) -> list[float]:
    if isinstance(values, torch.Tensor):
        return [float(x) for x in values.detach().to("cpu", torch.float64).reshape(-1).tolist()]
    return [float(x) for x in np.asarray(values, dtype=np.float64).reshape(-1)]


def _check_weights(values: Sequence[float] | torch.Tensor, n: int, *, where: str) -> list[float]:
    w = _to_float_list(values)
    if len(w) != n:
        raise ValueError(f"{where}: got {len(w)} values for {n} domains")
    bad = [x for x in w if not math.isfinite(x) or x < 0]
    if bad:
        raise ValueError(f"{where}: values must be finite and >= 0, got {bad}")
    total = math.fsum(w)
    if abs(total - 1.0) <= _SUM_TOL:
        return w
    if abs(total - 1.0) <= _RENORM_TOL:
        log.warning("%s: values sum to %.9g, renormalising to 1", where, total)
        return [x / total for x in w]
    raise ValueError(f"{where}: values must sum to 1 (within {_RENORM_TOL}), got sum {total:.9g}")


def _read_weight_map(obj: Any, names: list[str], *, where: str) -> dict[str, float]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object mapping domain name to weight, got {obj!r}")
    if set(obj) != set(names):
        raise ValueError(
            f"{where} keys {sorted(obj)} must equal `domains` {sorted(names)} "
            f"(missing {sorted(set(names) - set(obj))}, unknown {sorted(set(obj) - set(names))})"
        )
    try:
        raw = [float(obj[n]) for n in names]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: weights must be numbers ({e})") from e
    return dict(zip(names, _check_weights(raw, len(names), where=where), strict=True))
