"""`select_ahead: true`: the next step's selection made at AFTER_TRAIN_BATCH, on the next pool fetched early."""

from __future__ import annotations

import pytest
import torch
from composer.loggers import InMemoryLogger

import train
from composer_algos.data_selection.ahead import PeekableLoader, PendingSelection, pool_key
from pipeline.config import load_config
from tests.common.paths import REPO_ROOT
from tests.training.conftest import full_and_resumed, tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
AHEAD = "algorithms.data_selection.select_ahead=true"


# ---------------------------------------------------------------- the loader
def test_peeked_batch_is_yielded_next_and_once():
    loader = PeekableLoader([10, 11, 12])
    it = iter(loader)
    assert next(it) == 10 and not loader.yielded_ahead
    assert loader.peek() == 11 and loader.peek() == 11  # fetched once, kept
    assert next(it) == 11 and loader.yielded_ahead
    assert next(it) == 12 and not loader.yielded_ahead
    assert loader.peek() is None  # the pass has ended
    assert list(it) == []


def test_a_new_pass_starts_over_and_ends_the_old_one():
    loader = PeekableLoader([1, 2, 3])
    assert loader.peek() is None  # no pass yet
    first = iter(loader)
    assert next(first) == 1 and loader.peek() == 2
    assert list(loader) == [1, 2, 3]  # a new pass: the old one's early batch is not carried over
    assert list(first) == []
    assert len(loader) == 3


def test_attributes_are_the_wrapped_loaders_and_a_distributed_sampler_gets_the_epoch():
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(8))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    epoch = [0]
    loader = PeekableLoader(DataLoader(data, batch_size=2, sampler=sampler), epoch=lambda: epoch[0])
    assert loader.batch_size == 2 and loader.dataset is data
    first = [t.tolist() for t in loader]
    epoch[0] = 1
    second = [t.tolist() for t in loader]
    assert sampler.epoch == 1 and first != second  # reshuffled by epoch, as Composer does for a DataLoader


def test_pending_selection_matches_its_pool_only():
    pool = {"domain_id": torch.tensor([0, 1, 1]), "sample_id": torch.tensor([5, 6, 7]), "input_ids": torch.zeros(3, 4)}
    pending = PendingSelection(4, pool_key(pool, "domain_id"), {"input_ids": torch.zeros(1, 4)}, {})
    assert pending.matches(4, pool, "domain_id")
    assert not pending.matches(5, pool, "domain_id")
    assert not pending.matches(4, {**pool, "sample_id": torch.tensor([5, 6, 8])}, "domain_id")
    assert not pending.matches(4, {**pool, "domain_id": torch.tensor([0, 1])}, "domain_id")
    restored = PendingSelection.from_state(pending.state_dict())
    assert restored.restored and restored.matches(4, pool, "domain_id")


def test_select_ahead_is_refused_under_fsdp2_on_several_ranks(monkeypatch):
    """FSDP1 (fsdp_config) on several ranks is verified (tests/features/test_fsdp.py: the scoring pass between a
    backward and its optimizer step, in `sharded_fsdp_units_kept`); FSDP2's `fully_shard` is not, so it is refused."""
    from types import SimpleNamespace

    from composer.utils import dist
    from torch.distributed.fsdp import FSDPModule

    from composer_algos.data_selection import DataSelection

    algo = DataSelection(strategy="random", select_ahead=True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    block = torch.nn.Linear(2, 2)
    block.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})  # what fully_shard does to a module
    fields = {"dataloader": [], "dataloader_len": 3, "auto_microbatching": False}
    with pytest.raises(ValueError, match=r"not supported under FSDP2 \(parallelism_config.fsdp2\) on several ranks \(world size 2\)"):
        algo._wrap_loader(SimpleNamespace(model=torch.nn.Sequential(block), **fields))
    # Under FSDP1, or without FSDP, it goes on (to wrap the loader).
    state = SimpleNamespace(model=torch.nn.Sequential(torch.nn.Linear(2, 2)), **fields)
    state.dataloader_label, state.timestamp = "train", None
    state.set_dataloader = lambda loader, label, length: setattr(state, "dataloader", loader)
    algo._wrap_loader(state)
    assert isinstance(state.dataloader, PeekableLoader)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"dataloader_len": None}, "needs a train loader with a length"),
        ({"auto_microbatching": True}, "not supported with device_train_microbatch_size: auto on several ranks"),
    ],
    ids=["unsized-loader", "auto-microbatching"],
)
def test_select_ahead_on_several_ranks_refuses_what_it_cannot_coordinate(monkeypatch, state, message):
    from types import SimpleNamespace

    from composer.utils import dist

    from composer_algos.data_selection import DataSelection

    algo = DataSelection(strategy="random", select_ahead=True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    fields = {"model": torch.nn.Linear(2, 2), "dataloader": [], "dataloader_len": 3, "auto_microbatching": False, **state}
    with pytest.raises(ValueError, match=message):
        algo._wrap_loader(SimpleNamespace(**fields))


def test_a_distributed_batch_sampler_gets_the_epoch_and_release_ends_the_pass():
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]

    class DistributedBatches(DistributedSampler):  # a batch sampler that is a DistributedSampler
        def __iter__(self):
            return (batches[i] for i in super().__iter__())

    sampler = DistributedBatches(batches, num_replicas=1, rank=0, shuffle=True, seed=5)
    epoch = [3]
    loader = PeekableLoader(DataLoader(list(range(8)), batch_sampler=sampler), epoch=lambda: epoch[0])
    it = iter(loader)
    assert sampler.epoch == 3  # Composer's _get_distributed_sampler looks at the batch sampler first, as here
    next(it)
    assert loader.peek() is not None
    loader.release()
    assert loader.peek() is None and list(it) == []


def test_a_non_bool_select_ahead_is_refused_with_its_key():
    from composer_algos.data_selection import DataSelection

    with pytest.raises(ValueError, match="select_ahead must be true or false, got 'yes'"):
        DataSelection(strategy="random", select_ahead="yes")


# ---------------------------------------------------------------- in training
def _series(trainer, key):
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    return {int(ts.batch.value): v for ts, v in mem.data.get(key, [])}


def _traces(trainer, key):
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    return [v for _ts, v in mem.data.get(key, [])]


def _run(dolma_shards, run_dir, *extra):
    cfg = load_config(TINY, tiny_overrides(dolma_shards, run_dir, "loggers.in_memory={}", "eval_loader=null", *extra))
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    return trainer


WINDOWED = [
    "algorithms.data_selection.start=0.4", "algorithms.data_selection.interval=2",
    "algorithms.data_selection.between=stale_topk",
]


@pytest.mark.parametrize("extra", [[], WINDOWED], ids=["every-step", "window-interval-stale"])
def test_with_frozen_weights_the_selection_made_ahead_is_the_one_made_at_the_step(dolma_shards, tmp_path, extra):
    """lr 1e-30 (below every weight's last bit) and features without the optimizer's state: the weights and every
    other input of a selection are the same one step earlier, so the two modes must pick the same rows every step,
    and train on the same losses. With a window from 0.4 of 5 steps, every second step selecting and stale top-k
    between: a selection made ahead must judge the window at the step it is for (step 2 is the first in it)."""
    common = ["max_duration=5ba", "optimizer.lr=1e-30", "algorithms.data_selection.features.normalization=none", *extra]
    now = _run(dolma_shards, tmp_path / "now", *common)
    ahead = _run(dolma_shards, tmp_path / "ahead", *common, AHEAD)
    made_ahead = _series(ahead, "selection/made_ahead")
    assert made_ahead == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}  # the first step selects at the step
    h_now, h_ahead = _series(now, "selection/selected_hash"), _series(ahead, "selection/selected_hash")
    assert sorted(h_now) == list(range(5)) and h_ahead == h_now
    assert _series(ahead, "loss/train/total") == _series(now, "loss/train/total")
    pools_now = [t.tolist() for t in _traces(now, "selection/pool_sample_ids")]
    assert [t.tolist() for t in _traces(ahead, "selection/pool_sample_ids")] == pools_now  # no pool lost or repeated


def test_training_with_select_ahead_differs_from_selecting_at_the_step(dolma_shards, tmp_path):
    """With learning, a selection made ahead sees weights one step older: the picks may differ, the pools do not."""
    now = _run(dolma_shards, tmp_path / "now", "max_duration=6ba")
    ahead = _run(dolma_shards, tmp_path / "ahead", "max_duration=6ba", AHEAD)
    assert [t.tolist() for t in _traces(ahead, "selection/pool_sample_ids")] == [
        t.tolist() for t in _traces(now, "selection/pool_sample_ids")
    ]
    assert _series(ahead, "selection/made_ahead") == {0: 0.0, **{s: 1.0 for s in range(1, 6)}}
    # Step 1 is the first made ahead, with step 0's weights: its loss differs from the run selecting at the step
    # only through the picks, so equality everywhere would mean the weights never entered the selection.
    loss_now, loss_ahead = _series(now, "loss/train/total"), _series(ahead, "loss/train/total")
    assert loss_ahead[0] == loss_now[0]
    assert any(loss_ahead[s] != loss_now[s] for s in range(1, 6))


def test_a_select_ahead_run_resumes_bitwise(dolma_shards, tmp_path):
    full, resumed = full_and_resumed(dolma_shards, tmp_path, "loggers.in_memory={}", "eval_loader=null", AHEAD)
    resumed.close()
    # Step 3's selection was made at step 2, before the checkpoint: the resumed run trains on it (made ahead).
    assert _series(resumed, "selection/made_ahead") == {3: 1.0, 4: 1.0, 5: 1.0}
    for key in ("loss/train/total", "selection/selected_hash"):
        full_s, res_s = _series(full, key), _series(resumed, key)
        assert sorted(res_s) == [3, 4, 5]
        assert all(res_s[s] == full_s[s] for s in (3, 4, 5)), (key, res_s, full_s)


def _ahead_trainer(dolma_shards, run_dir, *extra):
    from composer_algos.data_selection.algorithm import find_data_selection

    cfg = load_config(TINY, tiny_overrides(dolma_shards, run_dir, "loggers.in_memory={}", "eval_loader=null", *extra))
    trainer = train.build_trainer(cfg)
    return trainer, find_data_selection(trainer.state)


AVERAGED = ["algorithms.data_selection.validation.average_beta=0.5", "max_duration=4ba"]


def test_after_train_batch_twice_selects_ahead_once(dolma_shards, tmp_path):
    """Composer runs a batch's microbatches again after an out-of-memory error in its optimizer step: the
    selection made ahead at the first AFTER_TRAIN_BATCH stands, its state changes are not made twice."""
    trainer, algo = _ahead_trainer(dolma_shards, tmp_path, AHEAD, *AVERAGED)
    train_microbatches = trainer._train_microbatches

    def twice(microbatches, loss_dict, **kwargs):
        out = train_microbatches(microbatches, loss_dict, **kwargs)
        if int(trainer.state.timestamp.batch) == 1:  # what _train_batch's retry does
            for k in loss_dict:
                loss_dict[k].zero_()
            out = train_microbatches(microbatches, loss_dict, **kwargs)
        return out

    trainer._train_microbatches = twice
    made = []
    selection = algo._selection
    algo._selection = lambda state, batch, number, **kw: made.append((number, kw.get("ahead", False))) or selection(
        state, batch, number, **kw
    )
    trainer.fit()
    trainer.close()
    assert made == [(0, False), (1, True), (2, True), (3, True)]
    assert algo.val_average.count == 4  # one update a trained step


def test_a_discarded_selection_made_ahead_leaves_no_trace_in_the_state(dolma_shards, tmp_path, monkeypatch):
    """When the pool that arrives is not the one a selection was made for, the step selects anew, from the state
    before the discarded selection: the validation average counts each trained step once."""
    trainer, algo = _ahead_trainer(dolma_shards, tmp_path, AHEAD, *AVERAGED)
    matches = PendingSelection.matches
    monkeypatch.setattr(PendingSelection, "matches", lambda self, number, *a: number != 2 and matches(self, number, *a))
    trainer.fit()
    trainer.close()
    assert _series(trainer, "selection/made_ahead") == {0: 0.0, 1: 1.0, 2: 0.0, 3: 1.0}
    assert algo.val_average.count == 4


def test_a_checkpoint_on_several_ranks_holds_the_state_before_the_selection_made_ahead(dolma_shards, tmp_path, monkeypatch):
    """Rank 0's checkpoint cannot hold every rank's pending selection, so a resumed run on several ranks makes it
    again: the checkpoint must then hold the state from before it (one rank: the state after it, and it)."""
    from composer.core import Callback
    from composer.utils import dist

    trainer, algo = _ahead_trainer(dolma_shards, tmp_path, AHEAD, *AVERAGED)
    saved = {}

    class AtBatchEnd(Callback):
        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == 3:  # steps 0-2 trained, step 3's selection made
                saved[1] = algo.state_dict()
                with monkeypatch.context() as m:
                    m.setattr(dist, "get_world_size", lambda: 2)
                    saved[2] = algo.state_dict()

    trainer.state.callbacks.append(AtBatchEnd())
    trainer.fit()
    trainer.close()
    assert saved[1]["val_average"]["count"] == 4 and saved[1]["pending"]["number"] == 3
    assert saved[2]["val_average"]["count"] == 3 and saved[2]["pending"] is None
    assert algo.val_average.count == 4  # the swap for the checkpoint left the live state as it was


def test_selecting_ahead_leaves_the_step_being_trained_untouched(dolma_shards, tmp_path):
    """The selection for step 1 runs between step 0's backward and its optimizer step: step 0's update (weights and
    optimizer state) must be bit for bit the one without select_ahead."""
    from composer.core import Callback

    def after_step_0(run_dir, *extra):
        trainer, _ = _ahead_trainer(dolma_shards, run_dir, "max_duration=2ba", *extra)
        got = {}

        class AtBatchEnd(Callback):
            def batch_end(self, state, logger):
                if int(state.timestamp.batch) == 1:
                    got["params"] = [p.detach().clone() for p in state.model.parameters()]
                    opt_state = state.optimizers[0].state.values()
                    got["moments"] = [v.clone() for s in opt_state for v in s.values() if torch.is_tensor(v)]

        trainer.state.callbacks.append(AtBatchEnd())
        trainer.fit()
        trainer.close()
        return got, trainer

    ahead, trainer = after_step_0(tmp_path / "ahead", AHEAD)
    now, _ = after_step_0(tmp_path / "now")
    assert _series(trainer, "selection/made_ahead") == {0: 0.0, 1: 1.0}  # step 1's selection was made in step 0
    assert len(ahead["params"]) == len(now["params"]) > 0 and len(ahead["moments"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(ahead["params"], now["params"]))
    assert all(torch.equal(a, b) for a, b in zip(ahead["moments"], now["moments"]))


def test_a_batch_transform_turns_select_ahead_off_and_the_run_selects_at_the_step(dolma_shards, tmp_path, caplog):
    """A DataSpec whose batch_transforms makes a new batch: the subset made from the untransformed pool would bypass
    it, so the step selects anew and select_ahead turns off: the run then trains exactly as one without it."""
    runs = {}
    for mode, extra in (("ahead", [AHEAD]), ("now", [])):
        trainer, _ = _ahead_trainer(dolma_shards, tmp_path / mode, "max_duration=4ba", *extra)
        trainer._train_data_spec.batch_transforms = lambda batch: dict(batch)
        with caplog.at_level("WARNING"):
            trainer.fit()
        trainer.close()
        runs[mode] = trainer
    assert "select_ahead turned off for the rest of the run" in caplog.text
    for key in ("selection/selected_hash", "loss/train/total"):
        assert _series(runs["ahead"], key) == _series(runs["now"], key) and len(_series(runs["now"], key)) == 4
