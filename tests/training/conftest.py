"""Fixtures for training tests: small Dolma-style and MetaMathQA-style shards built with tools/shard.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import shard as shard_tool  # noqa: E402  (tools/shard.py, the CLI users run)
from sample_corpus import write_sample_corpus  # noqa: E402  (tools/sample_corpus.py)

SEQ_LEN = 64


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train_corpus")
    write_sample_corpus(root, seed=0, scale=0.1)
    return root


@pytest.fixture(scope="session")
def dolma_shards(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "dolma"
    rc = shard_tool.main(
        ["dolma", str(corpus_dir / "dolma" / "documents"), "--out", str(out), "--max-seq-len", str(SEQ_LEN),
         "--val-count", "8", "--no-progress"]
    )
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def math_shards(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "metamathqa"
    rc = shard_tool.main(
        ["metamathqa", str(corpus_dir / "metamathqa" / "MetaMathQA-sample.json"), "--out", str(out),
         "--max-seq-len", "128", "--val-count", "4", "--no-progress"]
    )
    assert rc == 0
    return out


def tiny_overrides(shard_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """Overrides turning yamls/testing/tiny_dolma.yaml into a seconds-long CPU run."""
    return [
        f"variables.shard_dir={shard_dir}",
        f"variables.max_seq_len={SEQ_LEN}",
        f"save_folder={run_dir}",
        "global_train_batch_size=4",
        "max_duration=3ba",
        "eval_interval=3ba",
        "eval_loader.device_eval_batch_size=8",
        "eval_loader.subset_num_batches=1",
        "console_log_interval=1ba",
        "python_log_level=warning",
        "model.config.hidden_size=32",
        "model.config.intermediate_size=64",
        "algorithms.data_selection.oversampling=3",
        "algorithms.data_selection.features.proj_dim=32",
        "algorithms.data_selection.validation.batch_size=2",
        *extra,
    ]


def full_and_resumed(shard_dir: Path, run_root: Path, *overrides: str, steps: int = 6, at: int = 3):
    """Two runs of yamls/testing/tiny_dolma.yaml: `steps` batches with a checkpoint at batch `at`, and a
    run resumed from that checkpoint to `steps`. Returns the (closed) full trainer and the resumed one."""
    import train
    from pipeline.config import load_config
    from tests.common.paths import REPO_ROOT

    tiny = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
    common = [*overrides, f"max_duration={steps}ba"]
    full = train.build_trainer(
        load_config(tiny, tiny_overrides(shard_dir, run_root / "full", *common, f"save_interval={at}ba"))
    )
    full.fit()
    ckpt = run_root / "full" / f"ep0-ba{at}-rank0.pt"
    assert ckpt.exists(), ckpt
    full.close()
    resumed = train.build_trainer(
        load_config(tiny, tiny_overrides(shard_dir, run_root / "resumed", *common, f"load_path={ckpt}"))
    )
    resumed.fit()
    return full, resumed


@pytest.fixture
def no_streaming_cleanup(monkeypatch):
    """train.main without its machine-wide cleaning of killed runs' Streaming files, for tests of what it refuses:
    run beside test_infra's cleaner test in the other xdist worker, it removed the killed run's entries first."""
    from pipeline import streaming_cleanup

    monkeypatch.setattr(streaming_cleanup, "clean_stale_streaming_resources", lambda *a, **k: [])
