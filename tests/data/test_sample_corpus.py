"""The sample-corpus generator: determinism, the three layouts, imbalanced and noisy domains, correct math, valid SELFIES."""

from __future__ import annotations

import collections
import gzip
import json
import re
import zlib
from pathlib import Path

import pytest
from sample_corpus import (  # noqa: E402  (tools/sample_corpus.py)
    generate_dolma_documents,
    generate_metamathqa,
    generate_mol_instructions,
    write_sample_corpus,
)

from tests.data.conftest import SCALE

PAPER_SHARES = {  # MetaMathQA type shares in the paper's figure (percent)
    "GSM_AnsAug": 20.3, "GSM_Rephrased": 20.3, "MATH_AnsAug": 18.9, "MATH_Rephrased": 12.7,
    "GSM_FOBAR": 10.1, "GSM_SV": 10.1, "MATH_FOBAR": 3.8, "MATH_SV": 3.8,
}  # fmt: skip
MOL_TASKS = {"description_guided_molecule_design", "forward_reaction_prediction", "reagent_prediction", "retrosynthesis"}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_differs(tmp_path, sample_corpus):
    write_sample_corpus(tmp_path / "again", seed=0, scale=SCALE)
    write_sample_corpus(tmp_path / "other", seed=1, scale=SCALE)
    base = _tree(sample_corpus)
    assert _tree(tmp_path / "again") == base
    other = _tree(tmp_path / "other")
    assert other.keys() == base.keys() and all(other[k] != base[k] for k in base)


def test_dolma_layout_and_schema(sample_corpus):
    files = sorted((sample_corpus / "dolma" / "documents").rglob("*"))
    files = [f for f in files if f.is_file()]
    assert files and all(f.name.endswith(".json.gz") for f in files)
    ids = set()
    sources = collections.Counter()
    for f in files:
        for line in gzip.decompress(f.read_bytes()).split(b"\n"):
            if not line:
                continue
            doc = json.loads(line)
            assert set(doc) == {"id", "text", "source", "added", "created", "metadata"}
            assert doc["source"] == f.parent.name and doc["text"].strip() and isinstance(doc["metadata"], dict)
            ids.add(doc["id"])
            sources[doc["source"]] += 1
    assert len(ids) == sum(sources.values())
    assert set(sources) == {"common-crawl", "wiki", "stackexchange", "reddit", "spam"}


def test_dolma_sources_differ_in_size_and_quality():
    docs = generate_dolma_documents(seed=0, scale=0.3)
    sizes = {s: sum(len(d["text"]) for d in v) for s, v in docs.items()}
    assert max(sizes.values()) > 4 * min(sizes.values())
    # Noise: the spam source compresses far worse and has far fewer plain words than every other source.
    def plain_word_share(text: str) -> float:
        words = text.split()
        return sum(bool(re.fullmatch(r"[A-Za-z][a-z]*[,.?!]?", w)) for w in words) / len(words)

    def compressibility(text: str) -> float:
        return len(zlib.compress(text.encode())) / len(text.encode())

    joined = {s: " ".join(d["text"] for d in v) for s, v in docs.items()}
    clean = [s for s in joined if s != "spam"]
    assert compressibility(joined["spam"]) > 2 * max(compressibility(joined[s]) for s in clean)
    assert plain_word_share(joined["spam"]) < 0.6 * min(plain_word_share(joined[s]) for s in clean)
    # Readers must cope with Unicode line separators inside records; the corpus has some.
    assert any("\u2028" in d["text"] for d in docs["common-crawl"]) and any("\u2029" in d["text"] for d in docs["spam"])


def test_default_scale_gives_the_demo_enough_dolma_tokens(tokenizer):
    texts = [d["text"] for docs in generate_dolma_documents(seed=0, scale=1.0).values() for d in docs]
    n_tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    assert 500_000 <= n_tokens <= 2_000_000


def test_metamathqa_types_follow_the_paper_shares(sample_corpus):
    records = json.loads((sample_corpus / "metamathqa" / "MetaMathQA-sample.json").read_text())
    assert all(set(r) == {"query", "response", "type", "original_question"} for r in records)
    counts = collections.Counter(r["type"] for r in records)
    assert set(counts) == set(PAPER_SHARES)
    for t, share in PAPER_SHARES.items():
        assert abs(counts[t] - share / 100 * len(records)) <= 1


_ARITH = re.compile(r"(?<![\w.$])(-?\d+(?:\s*[-+*/]\s*-?\d+)+)\s*=\s*(-?\d+)(?![\d.])")


def _x_question(query: str) -> str:
    return re.split(r"\nIf we know the answer| The answer is -?\d", query)[0]


@pytest.mark.parametrize("seed", [0, 7])
def test_metamathqa_answers_are_arithmetically_correct(seed):
    records = generate_metamathqa(seed=seed, scale=0.5)
    for r in records:
        answer = re.fullmatch(r"(?s).*\nThe answer is: (-?\d+)", r["response"])
        assert answer, r["response"]
        value = int(answer.group(1))
        equalities = _ARITH.findall(r["response"])
        for lhs, rhs in equalities:
            assert eval(lhs.replace("/", "//") if "/" in lhs else lhs) == int(rhs), (lhs, rhs, r)  # digits and + - * / only
        if r["type"] in ("GSM_AnsAug", "GSM_Rephrased"):
            assert equalities, r  # every GSM solution shows checkable arithmetic
        variant = r["type"].split("_", 1)[1]
        if variant in ("SV", "FOBAR"):
            # Putting the answer back for the unknown must give the original question.
            var = "X" if r["type"].startswith("MATH") else "x"
            restored = re.sub(rf"(?<![A-Za-z]){var}(?![A-Za-z])", str(value), _x_question(r["query"]))
            assert restored == r["original_question"], r
        else:
            boxed = re.findall(r"\\boxed\{(-?\d+)\}", r["response"])
            if r["type"].startswith("MATH"):
                assert boxed == [str(value)], r
            else:
                assert _ARITH.findall(r["response"])[-1][1] == str(value), r
            if variant == "AnsAug":
                assert r["query"] == r["original_question"]
            else:
                assert r["query"] != r["original_question"]


def test_mol_instructions_layout_and_valid_selfies(sample_corpus):
    selfies = pytest.importorskip("selfies")
    chem = pytest.importorskip("rdkit.Chem")
    from rdkit import RDLogger

    RDLogger.DisableLog("rdApp.*")
    files = sorted((sample_corpus / "mol_instructions").glob("*.json"))
    assert {f.stem for f in files} == MOL_TASKS
    molecule = re.compile(r"(\[[^\[\]]+\])+")
    splits = collections.Counter()
    for f in files:
        for r in json.loads(f.read_text()):
            assert set(r) == {"instruction", "input", "output", "metadata"} and r["metadata"]["task"] == f.stem
            splits[r["metadata"]["split"]] += 1
            side = r["input"].replace(">>", ".") if f.stem != "description_guided_molecule_design" else ""
            for mol in [m for m in (side.split(".") if side else [])] + r["output"].split("."):
                assert molecule.fullmatch(mol), mol
                smiles = selfies.decoder(mol)
                assert smiles and chem.MolFromSmiles(smiles) is not None, mol
    assert set(splits) == {"train", "test"} and 0.05 < splits["test"] / sum(splits.values()) < 0.2


def test_mol_task_shares_are_imbalanced():
    counts = {t: len(v) for t, v in generate_mol_instructions(seed=0, scale=1.0).items()}
    assert set(counts) == MOL_TASKS
    assert counts["description_guided_molecule_design"] > 2 * counts["forward_reaction_prediction"]


def test_make_sample_corpus_cli(tmp_path, capsys):
    from tests.data.mds_helpers import load_tool

    assert load_tool("make_sample_corpus").main([str(tmp_path / "c"), "--scale", "0.02", "--seed", "3"]) == 0
    n_files = sum(1 for p in (tmp_path / "c").rglob("*") if p.is_file())
    assert f"wrote {n_files} files" in capsys.readouterr().out
    assert _tree(tmp_path / "c") == _tree(write_sample_corpus(tmp_path / "lib", seed=3, scale=0.02).root)
