"""`score_window`: pool and validation rows scored on t-token windows, each run as its own sequence."""

from __future__ import annotations

import pytest
import torch

from composer_algos.features import GradFeatureExtractor
from composer_algos.features.windows import take_windows, window_batch, window_positions
from pipeline.config import ConfigError
from tests.common.models import tiny_llama
from tests.common.paths import REPO_ROOT

M = -100


def _extractor(model, **kw):
    return GradFeatureExtractor(model, normalization="none", last_n_blocks=2, proj_dim=40, chunk_size=3, **kw)


def _packed(n: int, T: int, seed: int, short_rows: dict[int, int] | None = None) -> dict:
    """Packed pretraining rows (labels = inputs); `short_rows` {row: length} right-padded."""
    ids = torch.randint(0, 128, (n, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(n, T, dtype=torch.long)
    for r, length in (short_rows or {}).items():
        mask[r, length:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, M)}


def test_windows_of_a_batch_by_hand():
    batch = _packed(2, 10, seed=0, short_rows={1: 6})
    out = take_windows(batch, 4, torch.tensor([3, 1]))
    ids = batch["input_ids"]
    assert out["input_ids"].tolist() == [ids[0, 3:7].tolist(), ids[1, 1:5].tolist()]
    assert out["labels"].tolist() == out["input_ids"].tolist()  # labels = inputs inside the tokens
    assert out["attention_mask"].tolist() == [[1] * 4, [1] * 4]
    # A window over padding keeps the padding masked and ignored.
    pad = take_windows(batch, 4, torch.tensor([0, 4]))
    assert pad["attention_mask"][1].tolist() == [1, 1, 0, 0] and pad["labels"][1, 2:].tolist() == [M, M]


def test_random_positions_stay_inside_each_rows_tokens_and_are_uniform():
    lengths = torch.tensor([10, 6, 3, 10] * 500)
    starts = window_positions(lengths, 4, position="random", seed=1, step=7)
    limit = (lengths - 4).clamp_min(0)
    assert bool((starts >= 0).all()) and bool((starts <= limit).all())
    assert bool((starts[lengths == 3] == 0).all())  # a row shorter than the window is kept from 0
    full = starts[lengths == 10]  # 7 admissible starts, 1000 draws: every one occurs, none dominates
    counts = torch.bincount(full, minlength=7)
    assert counts.shape[0] == 7 and int(counts.min()) > 80 and int(counts.max()) < 220


def test_random_windows_depend_only_on_seed_and_step_and_ranks_share_one_draw():
    lengths = torch.full((8,), 32)
    kw = {"position": "random", "seed": 5}
    whole = window_positions(lengths, 8, step=3, **kw)
    # Two ranks of 4 rows each take consecutive slices of the same global draw.
    rank0 = window_positions(lengths[:4], 8, step=3, row_offset=0, **kw)
    rank1 = window_positions(lengths[4:], 8, step=3, row_offset=4, **kw)
    assert torch.equal(torch.cat([rank0, rank1]), whole)
    # Another process (a resumed run) at the same step draws the same; another step or seed does not.
    assert torch.equal(window_positions(lengths, 8, step=3, **kw), whole)
    assert not torch.equal(window_positions(lengths, 8, step=4, **kw), whole)
    assert not torch.equal(window_positions(lengths, 8, step=3, position="random", seed=6), whole)
    # The validation stream is drawn independently of the pool's.
    assert not torch.equal(window_positions(lengths, 8, step=3, stream=1, **kw), whole)


@pytest.mark.parametrize("position", ["start", "random"])
def test_window_at_least_the_rows_length_gives_the_full_length_features(position):
    # Rows of 9 to 16 tokens in a batch of T = 16; a 16-token window covers every row (nothing cut),
    # a 12-token window covers the rows no longer than 12, which keep their features.
    model = tiny_llama(seed=0, dtype=torch.float64)
    pool = _packed(6, 16, seed=1, short_rows={3: 12, 4: 9, 5: 10})
    val = _packed(2, 16, seed=3)
    G_full, g_full = _extractor(model).compute(pool, val, step=2)
    G_16, g_16 = _extractor(model, score_window=16, score_window_position=position).compute(pool, val, step=2)
    assert torch.equal(G_16, G_full) and torch.equal(g_16, g_full)
    ex = _extractor(model, score_window=12, score_window_position=position)
    G_12, g_12 = ex.compute(pool, val, step=2)
    assert ex.score_length_in_use == 12
    scale = float(G_full.abs().max())
    torch.testing.assert_close(G_12[3:], G_full[3:], rtol=1e-5, atol=1e-6 * scale)  # rows of <= 12 tokens (float32 out)
    for i in range(3):  # rows of 16 tokens are cut: their features change, and so does the guide
        assert not torch.allclose(G_12[i], G_full[i], atol=1e-3 * scale)
    assert not torch.allclose(g_12, g_full, atol=1e-3 * float(g_full.abs().max()))


def test_window_features_equal_those_of_the_window_scored_as_its_own_batch():
    # The definition, checked from outside: the window at p is the sequence tokens[p : p + t] with no
    # left context, so the features equal those of a batch built from those tokens by hand.
    model = tiny_llama(seed=4, dtype=torch.float64)
    pool = _packed(5, 24, seed=2)
    t, step = 8, 11
    ex = _extractor(model, score_window=t, score_window_position="random", seed=9)
    G_w, _ = ex.compute(pool, step=step)
    starts = window_positions(torch.full((5,), 24), t, position="random", seed=9, step=step)
    assert len(set(starts.tolist())) > 1  # the draw really moves the windows
    by_hand = torch.stack([pool["input_ids"][i, p : p + t] for i, p in enumerate(starts.tolist())])
    ref = {"input_ids": by_hand, "attention_mask": torch.ones_like(by_hand), "labels": by_hand.clone()}
    G_ref, _ = _extractor(model, seed=9).compute(ref, step=step)
    torch.testing.assert_close(G_w, G_ref, rtol=1e-5, atol=1e-6 * float(G_ref.abs().max()))


def test_start_windows_are_a_slice_and_leave_other_fields():
    batch = {**_packed(3, 10, seed=0), "domain_id": torch.tensor([0, 1, 2])}
    out = window_batch(batch, 4, position="start", seed=0, step=0, stream=0)
    assert out["input_ids"].data_ptr() == batch["input_ids"].data_ptr()  # a view, no copy
    assert torch.equal(out["input_ids"], batch["input_ids"][:, :4]) and out["domain_id"] is batch["domain_id"]
    assert window_batch(batch, 10, position="random", seed=0, step=0, stream=0) is batch
    assert window_batch(batch, None, position="random", seed=0, step=0, stream=0) is batch


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"score_window": 1}, r"`score_window` must be None .* got 1"),
        ({"score_window": 2.5}, r"`score_window` must be None .* got 2\.5"),
        ({"score_window": 8, "score_window_position": "middle"}, r"`score_window_position` must be one of .* got 'middle'"),
        ({"score_window": 8, "score_tokens": 4}, r"`score_window` \(8\) and `score_tokens` \(4\) cannot both be set"),
    ],
)
def test_bad_window_options_are_rejected_naming_the_option_and_value(kw, match):
    with pytest.raises(ValueError, match=match):
        GradFeatureExtractor(tiny_llama(), **kw)


def test_config_keys_are_typed_and_checked():
    from composer_algos.registry import load_run_config

    tiny = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
    key = "algorithms.data_selection.features"
    feats = load_run_config(tiny, [f"{key}.score_window=64", f"{key}.score_window_position=random"])
    feats = feats.algorithms["data_selection"].features
    assert (feats.score_window, feats.score_window_position) == (64, "random")
    with pytest.raises(ConfigError, match=rf"{key}.*score_window_position.*got 'end'"):
        load_run_config(tiny, [f"{key}.score_window=64", f"{key}.score_window_position=end"])
