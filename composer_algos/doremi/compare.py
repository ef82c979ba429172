"""Compare domain mixtures (DoReMi's weights, selection runs' mixture.json) as tables (plots: tools/comparison_plots.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from composer_algos.mixture_io import MixtureFile, read_mixture_csv, read_mixture_json

log = logging.getLogger(__name__)

__all__ = [
    "MixtureColumn",
    "Trajectory",
    "natural_token_shares",
    "natural_sample_shares",
    "to_token_shares",
    "build_columns",
    "format_table",
    "format_markdown",
    "load_trajectory",
    "read_labelled",
    "total_variation",
]


@dataclass
class MixtureColumn:
    """One method's mixture as a table column.

    Attributes:
        label: Column header.
        weights: Domain name -> weight (domains the source lacks are absent).
        source: The file it came from (or a description).
    """

    label: str
    weights: dict[str, float]
    source: str


@dataclass
class Trajectory:
    """Per-step weights of one method, read from a `mixture_steps.csv`.

    Attributes:
        label: The method's label.
        steps: Step of each row.
        domain_names: Columns of `weights_SC`.
        weights_SC: Per-step weights, shape (S, C).
        capacity_steps: Steps of `capacities_SC` (the steps whose strategy ran within capacities).
        capacities_SC: Per-step capacity shares of a selection run (`capacity_steps.csv`; with
            `capacities: slack` the upper bounds), or None.
    """

    label: str
    steps: list[int]
    domain_names: list[str]
    weights_SC: np.ndarray
    capacity_steps: list[int] | None = None
    capacities_SC: np.ndarray | None = None


def natural_token_shares(shard_dir: str | os.PathLike, split: str = "train") -> dict[str, float]:
    """Each domain's share of the tokens of `split` in a shard manifest.

    Args:
        shard_dir: Directory holding the shard `manifest.json`.
        split: "train" (default) or "val".

    Returns:
        Domain name -> token share, in manifest order.

    Raises:
        ValueError: If the split holds no tokens.
    """
    return _split_shares(shard_dir, split, "tokens")


def natural_sample_shares(shard_dir: str | os.PathLike, split: str = "train") -> dict[str, float]:
    """Each domain's share of the examples (samples) of `split`: the units of the induced mixtures.

    `mixture.json` weights (a selection run's mean per-step share of trained examples, DoReMi's
    sampling proportions) are shares of examples, so this is the natural mixture to set them
    against; `natural_token_shares` with `to_token_shares` compares in tokens instead.

    Raises:
        ValueError: If the split holds no samples.
    """
    return _split_shares(shard_dir, split, "samples")


def _split_shares(shard_dir: str | os.PathLike, split: str, field: str) -> dict[str, float]:
    """Each domain's share of the split's `field` (`tokens` or `samples`) from the manifest."""
    from pipeline.manifest import load_manifest

    manifest = load_manifest(shard_dir)
    counts = {d.name: getattr(d.splits[split], field) if split in d.splits else 0 for d in manifest.domains}
    total = sum(counts.values())
    if total <= 0:
        raise ValueError(f"{shard_dir}: split {split!r} holds no {field}; cannot compute natural shares")
    return {n: c / total for n, c in counts.items()}


def to_token_shares(
    weights: dict[str, float], shard_dir: str | os.PathLike, split: str = "train"
) -> dict[str, float]:
    """Convert example shares into token shares with each domain's mean tokens per example in `split`.

    Raises:
        ValueError: a weighted domain the manifest lacks or has no samples of.
    """
    from pipeline.manifest import load_manifest

    manifest = load_manifest(shard_dir)
    per_example = {
        d.name: d.splits[split].tokens / d.splits[split].samples
        for d in manifest.domains
        if split in d.splits and d.splits[split].samples > 0
    }
    missing = sorted(n for n, w in weights.items() if w > 0 and n not in per_example)
    if missing:
        raise ValueError(
            f"{shard_dir}: domains {missing} have no {split!r} samples in the manifest; cannot convert to tokens"
        )
    tokens = {n: w * per_example.get(n, 0.0) for n, w in weights.items()}
    total = sum(tokens.values())
    return {n: t / total for n, t in tokens.items()} if total > 0 else tokens


def build_columns(
    doremi: MixtureFile | None,
    runs: Sequence[tuple[str, MixtureFile]],
    *,
    doremi_source: str = "doremi",
    natural: dict[str, float] | None = None,
    natural_source: str = "manifest",
    run_sources: Sequence[str] | None = None,
) -> tuple[list[str], list[MixtureColumn]]:
    """Assemble the table's domains (rows) and columns.

    Columns, in order: the natural shares (given, else the first file's `natural`), DoReMi's
    initial weights (when recorded) and learned weights, then each run.

    Args:
        doremi: DoReMi's mixture file, or None.
        runs: (label, file) for each other run.
        doremi_source: Where `doremi` came from (shown in messages).
        natural: Natural shares by domain (e.g. `natural_token_shares`), or None.
        natural_source: Where `natural` came from.
        run_sources: Where each run came from (default: its label).

    Returns:
        `(domain_names, columns)`. Domains follow `natural` if given, else the first file, with
        any further domains of later files appended.

    Raises:
        ValueError: If there is nothing to compare.
    """
    files = ([(doremi_source, doremi)] if doremi is not None else []) + [(lbl, f) for lbl, f in runs]
    if not files and natural is None:
        raise ValueError("nothing to compare: give --doremi and/or --runs")
    names: list[str] = list(natural) if natural is not None else []
    for _, f in files:
        names += [n for n in f.domain_names if n not in names]
    columns: list[MixtureColumn] = []
    if natural is not None:
        columns.append(MixtureColumn("natural", dict(natural), natural_source))
    else:
        first = next(((lbl, f) for lbl, f in files if f.natural is not None), None)
        if first is not None:
            columns.append(MixtureColumn("natural", dict(first[1].natural or {}), f"{first[0]} (`natural`)"))
    if doremi is not None:
        init = doremi.extra.get("initial_weights")
        if isinstance(init, dict):
            columns.append(MixtureColumn("DoReMi initial", {k: float(v) for k, v in init.items()}, doremi_source))
        columns.append(MixtureColumn("DoReMi", dict(doremi.weights), doremi_source))
    sources = list(run_sources) if run_sources is not None else [label for label, _ in runs]
    for (label, f), source in zip(runs, sources, strict=True):
        columns.append(MixtureColumn(label, dict(f.weights), source))
    for col in columns:
        missing = [n for n in names if n not in col.weights]
        if missing:
            log.warning("%s has no weight for domains %s (shown as '-')", col.label, missing)
    return names, columns


def total_variation(a: dict[str, float], b: dict[str, float], names: Sequence[str]) -> float:
    """Total-variation distance between two mixtures over `names` (missing weights count as 0)."""
    return 0.5 * sum(abs(a.get(n, 0.0) - b.get(n, 0.0)) for n in names)


def format_table(names: Sequence[str], columns: Sequence[MixtureColumn]) -> str:
    """A fixed-width text table: one row per domain, one column per method, plus a TV row."""
    width = max([len("domain"), len("TV vs natural"), *(len(n) for n in names)]) + 2
    colw = max([9, *(len(c.label) + 2 for c in columns)])
    lines = ["domain".ljust(width) + "".join(c.label.rjust(colw) for c in columns)]
    for n in names:
        lines.append(n.ljust(width) + "".join(_fmt(c.weights.get(n)).rjust(colw) for c in columns))
    natural = next((c for c in columns if c.label == "natural"), None)
    if natural is not None:
        tv = [total_variation(c.weights, natural.weights, names) for c in columns]
        lines.append("TV vs natural".ljust(width) + "".join(f"{x:.4f}".rjust(colw) for x in tv))
    return "\n".join(lines)


def format_markdown(names: Sequence[str], columns: Sequence[MixtureColumn]) -> str:
    """The same table in Markdown, with a sources list underneath."""
    lines = ["| domain | " + " | ".join(c.label for c in columns) + " |"]
    lines.append("|---|" + "---:|" * len(columns))
    for n in names:
        lines.append(f"| {n} | " + " | ".join(_fmt(c.weights.get(n)) for c in columns) + " |")
    natural = next((c for c in columns if c.label == "natural"), None)
    if natural is not None:
        tv = [total_variation(c.weights, natural.weights, names) for c in columns]
        lines.append("| *TV vs natural* | " + " | ".join(f"{x:.4f}" for x in tv) + " |")
    lines.append("")
    lines += [f"- **{c.label}**: {c.source}" for c in columns]
    return "\n".join(lines) + "\n"


def load_trajectory(label: str, json_path: str | os.PathLike) -> Trajectory | None:
    """Read the `mixture_steps.csv` (and `capacity_steps.csv`) next to a `mixture.json`, or None without one."""
    csv_path = Path(json_path).with_name("mixture_steps.csv")
    if not csv_path.is_file():
        return None
    steps, names, weights_SC = read_mixture_csv(csv_path)
    if not steps:
        return None
    trajectory = Trajectory(label, steps, names, weights_SC)
    cap_path = csv_path.with_name("capacity_steps.csv")
    if cap_path.is_file():
        cap_steps, cap_names, caps_SC = read_mixture_csv(cap_path)
        if cap_steps and cap_names == names:
            trajectory.capacity_steps, trajectory.capacities_SC = cap_steps, caps_SC
    return trajectory


def read_labelled(spec: str) -> tuple[str, MixtureFile, Path]:
    """Parse a `--runs` entry, `PATH` or `LABEL=PATH`; the default label is `<method> (<dir>)`.

    Raises:
        ValueError, FileNotFoundError: From `read_mixture_json`.
    """
    label, sep, path_s = spec.partition("=")
    if not sep or not label or Path(spec).exists():
        label, path_s = "", spec
    path = Path(path_s)
    if path.is_dir():
        path = path / "mixture.json"
    mix = read_mixture_json(path)
    return label or f"{mix.method} ({path.parent.name})", mix, path


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
