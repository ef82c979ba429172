"""Molecule-generation metrics as Mol-Instructions/MolT5 compute them (BLEU, Levenshtein, exact, validity, FPs)."""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "canonical_smiles",
    "char_bleu",
    "clean_selfies_prediction",
    "evaluate_predictions",
    "fingerprint_similarities",
    "is_selfies",
    "levenshtein",
    "molecule_metrics",
    "read_predictions",
    "selfies_to_smiles",
    "text_metrics",
]

log = logging.getLogger(__name__)

_REQUIRED = ("task", "prediction", "reference")


def selfies_to_smiles(selfies_str: str) -> str | None:
    """Decode SELFIES with ``selfies.decoder``; ``None`` when it fails or yields nothing.

    ``selfies`` skips text outside brackets, so plain words decode to an empty string, which
    counts as a failure here.
    """
    import selfies

    try:
        smiles = selfies.decoder(selfies_str.strip())
    except Exception:  # selfies.DecoderError and friends on malformed strings
        return None
    return smiles or None


def canonical_smiles(smiles: str | None, isomeric: bool = False) -> str | None:
    """RDKit canonical SMILES, or ``None`` when RDKit cannot parse it or it has no atoms.

    Args:
        smiles: A SMILES string.
        isomeric: Keep stereo and isotopes (default False, as Mol-Instructions' evaluation
            canonicalises with ``isomericSmiles=False``).
    """
    if not smiles:
        return None
    mol = _mol(smiles)
    return None if mol is None else _chem().MolToSmiles(mol, isomericSmiles=isomeric, canonical=True)


def clean_selfies_prediction(text: str) -> str:
    """Keep a generated SELFIES up to its last ``]`` (drops trailing words or EOS text), as Mol-Instructions does."""
    text = text.strip()
    cut = text.rfind("]")
    return text[: cut + 1] if cut >= 0 else text


def is_selfies(text: str) -> bool:
    """Whether a string is a decodable SELFIES (used to tell molecule tasks from text tasks)."""
    stripped = text.strip()
    return stripped.startswith("[") and stripped.endswith("]") and selfies_to_smiles(stripped) is not None


def char_bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU-4 over characters, in [0, 1].

    MolT5 and Mol-Instructions score molecule strings with NLTK's ``corpus_bleu`` on character
    lists (uniform 4-gram weights, corpus brevity penalty, no smoothing); sacrebleu's ``char``
    tokenizer with ``smooth_method="none"`` computes the same statistic. Whitespace is not a token.

    Args:
        predictions: Hypotheses.
        references: One reference per hypothesis.

    Returns:
        BLEU / 100 (0 when any n-gram order has no match, or for an empty corpus).

    Raises:
        ValueError: If the lengths differ.
    """
    from sacrebleu.metrics import BLEU

    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions for {len(references)} references")
    if not predictions:
        return 0.0
    bleu = BLEU(tokenize="char", smooth_method="none", effective_order=False)
    return bleu.corpus_score(list(predictions), [list(references)]).score / 100.0


def levenshtein(a: str, b: str) -> int:
    """Character edit distance (insertions, deletions, substitutions of cost 1) via rapidfuzz."""
    from rapidfuzz.distance import Levenshtein

    return int(Levenshtein.distance(a, b))


def fingerprint_similarities(smiles_a: str, smiles_b: str, morgan_radius: int = 2) -> dict[str, float] | None:
    """Tanimoto similarities of MACCS keys, RDKit path fingerprints and Morgan count fingerprints.

    These are MolT5's ``fingerprint_metrics.py`` choices: ``MACCSkeys.GenMACCSKeys``,
    ``Chem.RDKFingerprint`` and unhashed Morgan counts of radius 2 (the old
    ``GetMorganFingerprint(m, 2)``, here through ``rdFingerprintGenerator``).

    Args:
        smiles_a: First molecule.
        smiles_b: Second molecule.
        morgan_radius: Morgan radius (default 2).

    Returns:
        ``{"maccs", "rdk", "morgan"}`` similarities, or ``None`` if either SMILES does not parse.
    """
    from rdkit import DataStructs
    from rdkit.Chem import MACCSkeys, rdFingerprintGenerator

    mol_a, mol_b = _mol(smiles_a), _mol(smiles_b)
    if mol_a is None or mol_b is None:
        return None
    chem = _chem()
    morgan = rdFingerprintGenerator.GetMorganGenerator(radius=morgan_radius)
    return {
        "maccs": float(
            DataStructs.TanimotoSimilarity(MACCSkeys.GenMACCSKeys(mol_a), MACCSkeys.GenMACCSKeys(mol_b))
        ),
        "rdk": float(DataStructs.TanimotoSimilarity(chem.RDKFingerprint(mol_a), chem.RDKFingerprint(mol_b))),
        "morgan": float(
            DataStructs.TanimotoSimilarity(
                morgan.GetSparseCountFingerprint(mol_a), morgan.GetSparseCountFingerprint(mol_b)
            )
        ),
    }


def molecule_metrics(
    predictions: Sequence[str], references: Sequence[str], *, drop_invalid: bool = True
) -> dict[str, float]:
    """Metrics of SELFIES predictions against SELFIES references (one task).

    A prediction is *valid* when it decodes (``selfies.decoder``) to a non-empty SMILES that RDKit
    parses. Mol-Instructions' ``evaluate.py`` drops invalid predictions (and unparsable
    references) before computing BLEU, Levenshtein and exact match; ``drop_invalid=True`` (the
    default) reproduces that, ``False`` scores every example (invalid ones count as no match).

    Returned keys:

    - ``n``: examples; ``n_scored``: examples BLEU/exact/``levenshtein_selfies`` were computed on (integers).
    - ``validity``: valid predictions / n.
    - ``bleu``: character-level corpus BLEU on the SELFIES strings, in [0, 1] (what the paper and
      Mol-Instructions report as BLEU).
    - ``levenshtein``: mean edit distance between canonical (non-isomeric) SMILES over valid pairs
      (Mol-Instructions' "SMILES Levenshtein"; NaN without valid pairs).
    - ``levenshtein_selfies``: mean edit distance between the SELFIES strings.
    - ``exact_match``: fraction whose molecule equals the reference (same InChI; canonical SMILES
      when InChI is unavailable); ``exact_string``: identical SELFIES strings.
    - ``maccs``, ``rdk``, ``morgan``: mean Tanimoto similarities over valid pairs (NaN without).

    Args:
        predictions: Generated SELFIES (cleaned with `clean_selfies_prediction`).
        references: Gold SELFIES.
        drop_invalid: Follow Mol-Instructions and score only valid pairs (default True).

    Returns:
        The metrics above.

    Raises:
        ValueError: If the lengths differ or there are no examples.
    """
    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions for {len(references)} references")
    if not predictions:
        raise ValueError("no predictions to score")
    preds = [clean_selfies_prediction(p) for p in predictions]
    refs = [r.strip() for r in references]
    pred_smi = [canonical_smiles(selfies_to_smiles(p)) for p in preds]
    ref_smi = [canonical_smiles(selfies_to_smiles(r)) for r in refs]
    valid_pair = [p is not None and r is not None for p, r in zip(pred_smi, ref_smi)]
    scored = [i for i in range(len(preds)) if valid_pair[i] or not drop_invalid]

    exact = [_same_molecule(pred_smi[i], ref_smi[i]) for i in scored]
    pairs = [(p, r) for p, r in zip(pred_smi, ref_smi) if p is not None and r is not None]
    fps = [f for f in (fingerprint_similarities(p, r) for p, r in pairs) if f is not None]
    smiles_levs = [levenshtein(p, r) for p, r in pairs]
    return {
        "n": len(preds),
        "n_scored": len(scored),
        "validity": sum(p is not None for p in pred_smi) / len(preds),
        "bleu": char_bleu([preds[i] for i in scored], [refs[i] for i in scored]),
        "levenshtein": _mean(smiles_levs),
        "levenshtein_selfies": _mean([levenshtein(preds[i], refs[i]) for i in scored]),
        "exact_match": _mean([float(e) for e in exact]),
        "exact_string": _mean([float(preds[i] == refs[i]) for i in scored]),
        "maccs": _mean([f["maccs"] for f in fps]),
        "rdk": _mean([f["rdk"] for f in fps]),
        "morgan": _mean([f["morgan"] for f in fps]),
    }


def text_metrics(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Metrics for tasks whose outputs are text or numbers (no molecule checks).

    Returns ``n`` (an integer), ``bleu`` (sacrebleu corpus BLEU with its default ``13a`` word tokenizer, in
    [0, 1]), ``levenshtein`` (mean character edit distance) and ``exact_match`` (after stripping).

    Raises:
        ValueError: If the lengths differ or there are no examples.
    """
    from sacrebleu.metrics import BLEU

    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions for {len(references)} references")
    if not predictions:
        raise ValueError("no predictions to score")
    preds = [p.strip() for p in predictions]
    refs = [r.strip() for r in references]
    return {
        "n": len(preds),
        "bleu": BLEU().corpus_score(preds, [refs]).score / 100.0,
        "levenshtein": _mean([levenshtein(p, r) for p, r in zip(preds, refs)]),
        "exact_match": _mean([float(p == r) for p, r in zip(preds, refs)]),
    }


def evaluate_predictions(
    records: Iterable[dict[str, Any]], *, drop_invalid: bool = True
) -> dict[str, dict[str, float]]:
    """Per-task metrics of ``{"task", "prediction", "reference"}`` records.

    A task is scored with `molecule_metrics` when most of its references are SELFIES, otherwise
    with `text_metrics`. An ``"average"`` entry holds the unweighted mean over tasks of every
    metric that all tasks share.

    Args:
        records: Prediction records.
        drop_invalid: Passed to `molecule_metrics`.

    Returns:
        ``{task: metrics, ..., "average": metrics}``.

    Raises:
        ValueError: If a record lacks a field or there are no records.
    """
    by_task: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for i, rec in enumerate(records):
        missing = [k for k in _REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"prediction record {i} is missing field(s) {missing}; expected {list(_REQUIRED)}")
        by_task[str(rec["task"])][0].append(str(rec["prediction"]))
        by_task[str(rec["task"])][1].append(str(rec["reference"]))
    if not by_task:
        raise ValueError("no prediction records")
    out: dict[str, dict[str, float]] = {}
    for task, (preds, refs) in by_task.items():
        molecule_task = sum(is_selfies(r) for r in refs) * 2 > len(refs)
        out[task] = (
            molecule_metrics(preds, refs, drop_invalid=drop_invalid) if molecule_task else text_metrics(preds, refs)
        )
    shared = set.intersection(*(set(m) for m in out.values())) - {"n", "n_scored"}
    out["average"] = {k: _mean([m[k] for m in out.values()]) for k in sorted(shared)}
    return out


def read_predictions(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON Lines file of ``{"task", "prediction", "reference"}`` records.

    Raises:
        ValueError: Naming the line that is not JSON or lacks a field.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f.read().split("\n"), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {lineno} is not JSON ({err.msg})") from err
            missing = [k for k in _REQUIRED if k not in rec]
            if missing:
                raise ValueError(f"{path}: line {lineno} is missing field(s) {missing}; expected {list(_REQUIRED)}")
            records.append(rec)
    return records


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan


def _chem():
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")  # RDKit prints a line per unparsable SMILES otherwise
    return Chem


def _mol(smiles: str):
    """An RDKit molecule with at least one atom, or None."""
    mol = _chem().MolFromSmiles(smiles)
    return mol if mol is not None and mol.GetNumAtoms() > 0 else None


def _same_molecule(smiles_a: str | None, smiles_b: str | None) -> bool:
    """InChI equality (MolT5's exact match); canonical SMILES equality when InChI is unavailable."""
    if smiles_a is None or smiles_b is None:
        return False
    chem = _chem()
    mol_a, mol_b = _mol(smiles_a), _mol(smiles_b)
    if mol_a is None or mol_b is None:
        return False
    try:
        inchi_a, inchi_b = chem.MolToInchi(mol_a), chem.MolToInchi(mol_b)
    except Exception:  # RDKit built without InChI support
        inchi_a = inchi_b = ""
    if inchi_a and inchi_b:
        return inchi_a == inchi_b
    return smiles_a == smiles_b
