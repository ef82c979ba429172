"""tools/studies/lookahead.py reads its held-out examples where the run's evaluators do (eval_loader)."""

from __future__ import annotations

import argparse
from pathlib import Path

import lookahead as lookahead_tool  # noqa: E402  (tools/studies/lookahead.py)
import pytest
import shard as shard_tool  # noqa: E402
import split_documents  # noqa: E402
from sample_corpus import write_sample_corpus  # noqa: E402

from tests.common.paths import REPO_ROOT

YAML = REPO_ROOT / "yamls" / "study" / "ghpile.yaml"
SEQ = 32


@pytest.fixture(scope="module")
def ghpile_like(tmp_path_factory) -> tuple[Path, Path]:
    """Training shards (train documents, guide documents as val) and evaluation shards (evaluation
    documents as val), written as the ghpile study writes them."""
    root = tmp_path_factory.mktemp("ghpile_like")
    write_sample_corpus(root / "corpus", seed=0, scale=0.05)
    docs = root / "docs"
    assert split_documents.main([str(root / "corpus" / "dolma" / "documents"), "--out", str(docs),
                                 "--part", "guide=0.2", "--part", "eval=0.2"]) == 0
    shards = {}
    for name, train, val in (("s", "train", "guide"), ("s_eval", "guide", "eval")):
        shards[name] = root / name
        rc = shard_tool.main(["dolma", str(docs / train), "--val-file", str(docs / val), "--out", str(shards[name]),
                              "--tokenizer", str(REPO_ROOT / "assets" / "ghpile_tokenizer"),
                              "--max-seq-len", str(SEQ), "--no-progress"])
        assert rc == 0
    return shards["s"], shards["s_eval"]


def _rows(shard_dir: Path) -> list[tuple[int, ...]]:
    """The val split's rows (a list: the synthetic corpus repeats some texts)."""
    from pipeline.dataset import DomainStreamingDataset

    ds = DomainStreamingDataset(shard_dir=str(shard_dir), split="val", shuffle=False)
    return [tuple(int(x) for x in ds[i]["input_ids"]) for i in range(int(ds.num_samples))]


def _sequences(batch) -> list[tuple[int, ...]]:
    out = []
    for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
        out.append(tuple(int(x) for x, m in zip(ids, mask) if m))
    return out


def test_evaluation_rows_come_from_the_evaluation_shards_and_guide_rows_from_the_guide_split(ghpile_like):
    from pipeline.config import load_config

    train_shards, eval_shards = ghpile_like
    cfg = load_config(YAML, [f"variables.shard_dir={train_shards}", f"variables.max_seq_len={SEQ}"])
    assert cfg.eval_loader.shard_dir == f"{train_shards}_eval" == str(eval_shards)
    args = argparse.Namespace(pools=1, pool_size=4, guide_size=6, eval_size=10_000, seed=0)
    pools, guide, evalset, num_domains = lookahead_tool._data(cfg, args)
    guide_rows, eval_rows = _rows(train_shards), _rows(eval_shards)
    got_eval = _sequences(evalset)
    # Every evaluation row of the evaluation shards (guide_fraction 0: all of them), none of the guide's.
    assert sorted(got_eval) == sorted(eval_rows)
    assert len(_sequences(guide)) == 6 and set(_sequences(guide)) <= set(guide_rows)
    assert num_domains == 5 and pools[0]["input_ids"].shape == (4, SEQ)


@pytest.mark.parametrize("evaluators", ["none", "same_split"])
def test_on_one_val_split_the_held_out_part_is_the_part_that_never_guides(ghpile_like, evaluators):
    """No eval_loader, or one on the training shards' val split (the dm_math study's layout)."""
    from pipeline.config import load_config
    from pipeline.dataset import DomainStreamingDataset
    from pipeline.holdout import dataset_guide_mask

    train_shards, _ = ghpile_like
    where = (
        ["eval_loader=null"]
        if evaluators == "none"
        else [f"eval_loader.shard_dir={train_shards}", "eval_loader.guide_fraction=0.5"]
    )
    cfg = load_config(
        YAML,
        [f"variables.shard_dir={train_shards}", f"variables.max_seq_len={SEQ}", *where,
         "algorithms.data_selection.validation.guide_fraction=0.5"],
    )
    args = argparse.Namespace(pools=1, pool_size=4, guide_size=2, eval_size=10_000, seed=0)
    _, guide, evalset, _ = lookahead_tool._data(cfg, args)
    ds = DomainStreamingDataset(shard_dir=str(train_shards), split="val", shuffle=False)
    mask = dataset_guide_mask(ds, 0.5)
    held = [tuple(int(x) for x in ds[int(i)]["input_ids"]) for i in (~mask).nonzero()[0]]
    guiding = {tuple(int(x) for x in ds[int(i)]["input_ids"]) for i in mask.nonzero()[0]}
    assert sorted(_sequences(evalset)) == sorted(held)
    assert set(_sequences(guide)) <= guiding
