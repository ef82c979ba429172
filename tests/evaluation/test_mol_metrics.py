"""Molecule metrics on hand-made cases, with a slow reference BLEU kept here for parity."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from pipeline.evaluation.mol_eval import format_mol_table, load_mol_instructions, write_mol_results
from pipeline.evaluation.mol_metrics import (
    canonical_smiles,
    char_bleu,
    clean_selfies_prediction,
    evaluate_predictions,
    fingerprint_similarities,
    levenshtein,
    molecule_metrics,
    read_predictions,
    selfies_to_smiles,
)
from tests.common.paths import require_shared_data

ETHANOL = "[C][C][O]"
ETHANOL_REVERSED = "[O][C][C]"  # same molecule, different string
PROPANOL = "[C][C][C][O]"
BENZENE = "[C][=C][C][=C][C][=C][Ring1][=Branch1]"
ACETIC_ACID = "[C][C][=Branch1][C][=O][O]"


def _reference_corpus_bleu(hyps: list[list[str]], refs: list[list[str]]) -> float:
    """Papineni et al.'s corpus BLEU-4 written out: clipped n-gram counts, brevity penalty, no smoothing."""
    matches, totals = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for h, r in zip(hyps, refs):
        hyp_len += len(h)
        ref_len += len(r)
        for n in range(1, 5):
            h_ngrams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_ngrams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(c, r_ngrams[g]) for g, c in h_ngrams.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    if min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    bp = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return bp * math.exp(log_precision)


@pytest.mark.parametrize(
    ("hyps", "refs"),
    [
        ([ETHANOL, PROPANOL], [ETHANOL, BENZENE]),
        ([BENZENE], [BENZENE]),
        ([ACETIC_ACID, "[C][C]"], [ACETIC_ACID + "[C]", "[C][C][C][C][C]"]),  # short hypotheses: brevity penalty
        (["[N][C][C][O]", PROPANOL, ETHANOL], [PROPANOL, PROPANOL, "[C][C][C][C][O]"]),
    ],
)
def test_char_bleu_matches_reference_loop(hyps, refs):
    expected = _reference_corpus_bleu([list(h) for h in hyps], [list(r) for r in refs])
    assert char_bleu(hyps, refs) == pytest.approx(expected, abs=1e-9)


def test_char_bleu_extremes():
    assert char_bleu([BENZENE, ETHANOL], [BENZENE, ETHANOL]) == pytest.approx(1.0)
    assert char_bleu(["xyz"], ["[C]"]) == 0.0
    with pytest.raises(ValueError, match="1 predictions for 2 references"):
        char_bleu([ETHANOL], [ETHANOL, ETHANOL])


@pytest.mark.parametrize(("a", "b", "d"), [("kitten", "sitting", 3), ("[C][C][O]", "[C][O]", 3), ("", "abc", 3), ("CCO", "CCO", 0)])
def test_levenshtein(a, b, d):
    assert levenshtein(a, b) == d


@pytest.mark.parametrize(
    ("selfies_str", "smiles"),
    [(ETHANOL, "CCO"), ("[C][=C]", "C=C"), ("hello", None), ("[C]]", None), ("[Xx]", None), ("", None)],
)
def test_selfies_to_smiles(selfies_str, smiles):
    assert selfies_to_smiles(selfies_str) == smiles


def test_canonical_smiles_and_cleaning():
    assert canonical_smiles("OCC") == canonical_smiles("CCO") == "CCO"
    assert canonical_smiles("C1CC") is None  # unclosed ring
    assert canonical_smiles("") is None
    assert canonical_smiles("C[C@H](N)O") == "CC(N)O"  # stereo dropped, as Mol-Instructions does
    assert clean_selfies_prediction(" [C][C][O] is the product</s>") == "[C][C][O]"
    assert clean_selfies_prediction("no molecule") == "no molecule"


def test_fingerprint_similarities():
    same = fingerprint_similarities("CCO", "OCC")
    assert same == {"maccs": 1.0, "rdk": 1.0, "morgan": 1.0}
    near = fingerprint_similarities("CCCO", "CCCCO")
    far = fingerprint_similarities("CCCO", "c1ccccc1")
    assert near is not None and far is not None
    for key in ("maccs", "rdk", "morgan"):
        assert 0.0 <= far[key] < near[key] < 1.0
    assert fingerprint_similarities("CCO", "C1CC") is None


@pytest.mark.parametrize(("a", "b"), [("CCO", "CCCO"), ("CC(=O)O", "CC(=O)OC"), ("c1ccccc1O", "c1ccccc1N")])
def test_morgan_matches_molt5_call(a, b):
    """MolT5 scores Morgan similarity with the (now deprecated) count-based GetMorganFingerprint(m, 2)."""
    from rdkit import Chem, DataStructs
    from rdkit.Chem import AllChem

    ma, mb = Chem.MolFromSmiles(a), Chem.MolFromSmiles(b)
    expected = DataStructs.TanimotoSimilarity(AllChem.GetMorganFingerprint(ma, 2), AllChem.GetMorganFingerprint(mb, 2))
    sims = fingerprint_similarities(a, b)
    assert sims is not None and sims["morgan"] == pytest.approx(expected)
    assert 0.0 < sims["morgan"] < 1.0


def test_molecule_metrics_hand_made():
    preds = [ETHANOL_REVERSED, PROPANOL, "not a molecule", BENZENE + " done"]
    refs = [ETHANOL, ETHANOL, ETHANOL, BENZENE]
    m = molecule_metrics(preds, refs, drop_invalid=False)
    assert m["n"] == 4 and m["n_scored"] == 4
    assert m["validity"] == pytest.approx(3 / 4)
    # Same molecule written differently counts as exact; the string match does not.
    assert m["exact_match"] == pytest.approx(2 / 4)
    assert m["exact_string"] == pytest.approx(1 / 4)
    # SMILES edit distances over the 3 valid pairs: CCO/CCO 0, CCCO/CCO 1, benzene/benzene 0.
    assert m["levenshtein"] == pytest.approx(1 / 3)
    selfies_d = [levenshtein(ETHANOL_REVERSED, ETHANOL), levenshtein(PROPANOL, ETHANOL), levenshtein("not a molecule", ETHANOL), 0]
    assert m["levenshtein_selfies"] == pytest.approx(sum(selfies_d) / 4)
    cleaned = [ETHANOL_REVERSED, PROPANOL, "not a molecule", BENZENE]
    assert m["bleu"] == pytest.approx(char_bleu(cleaned, refs))
    assert m["maccs"] < 1.0 and m["morgan"] < 1.0


def test_drop_invalid_follows_mol_instructions():
    preds = [ETHANOL, "garbage", PROPANOL]
    refs = [ETHANOL, ETHANOL, PROPANOL]
    kept = molecule_metrics(preds, refs, drop_invalid=True)
    scored_all = molecule_metrics(preds, refs, drop_invalid=False)
    assert kept["n_scored"] == 2 and scored_all["n_scored"] == 3
    assert kept["exact_match"] == 1.0 and scored_all["exact_match"] == pytest.approx(2 / 3)
    assert kept["validity"] == scored_all["validity"] == pytest.approx(2 / 3)
    assert kept["bleu"] == pytest.approx(1.0) and scored_all["bleu"] < 1.0


def test_no_valid_pair_gives_nan_similarities():
    m = molecule_metrics(["junk"], [ETHANOL], drop_invalid=True)
    assert m["validity"] == 0.0 and m["n_scored"] == 0
    assert math.isnan(m["levenshtein"]) and math.isnan(m["maccs"]) and math.isnan(m["exact_match"])


def test_evaluate_predictions_groups_tasks_and_averages(tmp_path):
    records = [
        {"task": "forward", "prediction": ETHANOL, "reference": ETHANOL},
        {"task": "forward", "prediction": PROPANOL, "reference": ETHANOL},
        {"task": "retro", "prediction": BENZENE, "reference": BENZENE},
        {"task": "description", "prediction": "An alcohol.", "reference": "An alcohol."},
    ]
    path = tmp_path / "preds.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    out = evaluate_predictions(read_predictions(path))
    assert set(out) == {"forward", "retro", "description", "average"}
    assert out["forward"]["exact_match"] == 0.5 and out["retro"]["exact_match"] == 1.0
    assert "validity" in out["forward"] and "validity" not in out["description"]  # a text task
    assert out["description"]["exact_match"] == 1.0
    assert out["average"]["exact_match"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    table = format_mol_table(out)
    assert "forward" in table and "average" in table
    summary = write_mol_results(
        {"t": molecule_metrics(["junk"], [ETHANOL])}, tmp_path / "mol.json"
    )
    assert json.loads(summary.read_text())["tasks"]["t"]["maccs"] is None  # NaN -> null, strict JSON


def test_prediction_file_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"task": "t", "prediction": "[C]"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1 is missing field\(s\) \['reference'\]"):
        read_predictions(path)
    with pytest.raises(ValueError, match="no prediction records"):
        evaluate_predictions([])


def test_real_mol_instructions_files_load_and_score_as_text():
    data = require_shared_data("mol_instructions")
    examples = load_mol_instructions([data], split="test", limit_per_task=5)
    # The samples carry no metadata.split, so every record is kept (with a warning).
    assert sorted({e.task for e in examples}) == ["Chemical Entity Recognition", "True or False Question"]
    assert all(sum(e.task == t for e in examples) == 5 for t in {e.task for e in examples})
    records = [{"task": e.task, "prediction": e.reference, "reference": e.reference} for e in examples]
    out = evaluate_predictions(records)
    assert out["Chemical Entity Recognition"]["exact_match"] == 1.0
    assert "validity" not in out["Chemical Entity Recognition"]


def test_split_filter(tmp_path):
    recs = [
        {"instruction": "i", "input": ETHANOL, "output": PROPANOL, "metadata": {"task": "forward", "split": "train"}},
        {"instruction": "i", "input": ETHANOL, "output": BENZENE, "metadata": {"task": "forward", "split": "test"}},
    ]
    path = tmp_path / "forward_reaction_prediction.json"
    path.write_text(json.dumps(recs), encoding="utf-8")
    (ex,) = load_mol_instructions([path], split="test")
    assert ex.reference == BENZENE and ex.index == 1 and ex.task == "forward"
    assert len(load_mol_instructions([path], split=None)) == 2
