"""The llm-foundry plugin (composer_algos/foundry.py and the entry points in pyproject.toml) under llm-foundry itself.

These run in `.venv-foundry` (`make test-foundry`, llm-foundry 0.22 with Streaming 0.12); where
llmfoundry is not installed (the main `.venv`) the module is skipped.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llmfoundry", reason="llm-foundry is not installed here (make test-foundry installs it)")

from llmfoundry import registry  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from composer_algos import foundry  # noqa: E402
from composer_algos.data_selection.algorithm import DataSelection  # noqa: E402
from composer_algos.data_selection.mixture_monitor import MixtureMonitor  # noqa: E402
from composer_algos.registry import component_class, load_run_config  # noqa: E402
from pipeline.config import ConfigError  # noqa: E402
from pipeline.manifest import load_manifest  # noqa: E402
from tests.common.paths import REPO_ROOT  # noqa: E402
from tests.training.conftest import SEQ_LEN  # noqa: E402

TINY = REPO_ROOT / "yamls" / "foundry" / "tiny.yaml"
TINY_TRAIN_PY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
STEPS = 20
LLMFOUNDRY = Path(sys.executable).with_name("llmfoundry")  # the console script of this environment


def _tiny(shard_dir: Path, run_dir: Path, *extra: str) -> dict:
    """yamls/foundry/tiny.yaml as llm-foundry reads it, on the test shards, as a plain dict."""
    cfg = OmegaConf.merge(
        OmegaConf.load(TINY),
        OmegaConf.from_dotlist(
            [f"variables.shard_dir={shard_dir}", f"variables.max_seq_len={SEQ_LEN}", f"save_folder={run_dir}", *extra]
        ),
    )
    out = OmegaConf.to_container(cfg, resolve=True)
    out.pop("variables")
    return out


def _hashes(run_dir: Path) -> dict[int, str]:
    """Step -> `selected_hash` of the run's selection_log.csv (MixtureMonitor's, written by both trainers)."""
    with open(run_dir / "selection_log.csv", newline="") as f:
        return {int(row["step"]): row["selected_hash"] for row in csv.DictReader(f)}


# ---------------------------------------------------------------------------- registries
def test_entry_points_resolve_through_llm_foundrys_registries():
    assert registry.algorithms.get("data_selection") is DataSelection
    assert registry.callbacks.get("mixture_monitor") is MixtureMonitor
    assert registry.dataloaders.get("domain_shards") is foundry.build_domain_shards
    assert registry.dataloaders.get("domain_shards_eval") is foundry.build_domain_shards_eval
    assert registry.config_transforms.get("partitionsel") is foundry.complete_config
    # The very classes train.py builds by these names: every option, with its name and default, is the same.
    assert component_class("algorithm", "data_selection") is DataSelection
    assert component_class("callback", "mixture_monitor") is MixtureMonitor


def test_llm_foundry_builds_the_algorithm_with_the_yamls_options(dolma_shards, tmp_path):
    from llmfoundry.utils.builders import build_algorithm, build_callback

    cfg = _tiny(
        dolma_shards,
        tmp_path,
        "algorithms.data_selection.strategy=greats",
        "algorithms.data_selection.oversampling=3",
        "algorithms.data_selection.interval=2",
    )
    cfg = foundry.complete_config(cfg)
    algo = build_algorithm("data_selection", cfg["algorithms"]["data_selection"])
    assert isinstance(algo, DataSelection)
    assert (algo.strategy, algo.oversampling, algo.interval) == ("greats", 3.0, 2)
    assert algo.feature_cfg["proj_dim"] == 64 and algo.validation_cfg == {"batch_size": 4}
    assert algo.seed == 17  # the run's seed, as train.py passes it (DataSelection's own default is 0)
    assert algo.domain_names == [d.name for d in load_manifest(dolma_shards).domains]
    assert cfg["train_loader"]["oversampling"] == 3.0  # the pool: one owner, the algorithm

    monitor = build_callback("mixture_monitor", cfg["callbacks"]["mixture_monitor"], train_config=cfg)
    assert isinstance(monitor, MixtureMonitor)
    assert monitor.run_dir == tmp_path and monitor.domain_names == algo.domain_names
    assert monitor.natural is not None and sum(monitor.natural) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["tiny.yaml", "llama1b_dolma.yaml"])
def test_the_foundry_yamls_pass_llm_foundrys_config_validation(name, dolma_shards, tmp_path):
    from llmfoundry.utils.config_utils import TRAIN_CONFIG_KEYS, TrainConfig, make_dataclass_and_log_config

    cfg = OmegaConf.merge(OmegaConf.load(REPO_ROOT / "yamls" / "foundry" / name), {"variables": {"shard_dir": str(dolma_shards)}})
    _, train_cfg = make_dataclass_and_log_config(cfg, TrainConfig, TRAIN_CONFIG_KEYS, transforms="all")
    assert train_cfg.train_loader["name"] == "domain_shards" and train_cfg.train_loader["oversampling"] == 2.0
    assert train_cfg.algorithms["data_selection"]["seed"] == 17
    assert train_cfg.device_train_batch_size == train_cfg.global_train_batch_size  # one rank: kappa, not the pool


def test_a_missing_shard_directory_is_reported_as_a_config_problem(tmp_path):
    with pytest.raises(ConfigError, match=r"train_loader.dataset.shard_dir: .*no manifest"):
        foundry.complete_config(_tiny(tmp_path / "absent", tmp_path))


def test_a_config_without_the_plugins_components_is_left_alone():
    cfg = {"train_loader": {"name": "text", "dataset": {}}, "algorithms": {"gradient_clipping": {}}}
    assert foundry.complete_config(cfg) is cfg


# ---------------------------------------------------------------------------- the loaders
def test_the_train_loader_delivers_the_pool_with_domain_ids(dolma_shards, tmp_path):
    from llmfoundry.data.dataloader import build_dataloader
    from transformers import AutoTokenizer

    cfg = foundry.complete_config(_tiny(dolma_shards, tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "assets" / "tokenizer")
    spec = build_dataloader(cfg["train_loader"], tokenizer, 4)  # llm-foundry's device_train_batch_size
    batch = next(iter(spec.dataloader))
    assert batch["input_ids"].shape == (8, SEQ_LEN)  # oversampling 2 x 4 rows
    assert batch["domain_id"].shape == (8,) and int(batch["domain_id"].max()) < 5
    assert set(batch) >= {"attention_mask", "labels", "sample_id"}


def test_shards_of_another_tokenizer_are_refused_by_both_loaders(dolma_shards, tmp_path):
    # The shards hold assets/tokenizer's ids; a run under another tokenizer would fail in the embedding or misread.
    from llmfoundry.data.dataloader import build_dataloader
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    try:
        from train_tokenizer import EOS, PAD, corpus_texts, train
    finally:
        sys.path.pop(0)
    other = PreTrainedTokenizerFast(tokenizer_object=train(corpus_texts(0, 0.03), 400), eos_token=EOS, pad_token=PAD)
    cfg = foundry.complete_config(_tiny(dolma_shards, tmp_path))
    for key in ("train_loader", "eval_loader"):
        with pytest.raises(ConfigError, match=rf"{key}.dataset.shard_dir: tokenizer.name .* is not the tokenizer the "
                                              r"shards .*: vocabulary 400, smaller than the shards' 4096"):
            build_dataloader(cfg[key] if key == "train_loader" else _first_eval(cfg), other, 4)


def _first_eval(cfg: dict) -> dict:
    ev = cfg["eval_loader"]
    return ev[0] if isinstance(ev, list) else ev


def test_the_loader_reads_fine_tuning_shards_with_the_prompt_masked(math_shards, tmp_path):
    from llmfoundry.data.dataloader import build_dataloader
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "assets" / "tokenizer")
    loader = {"name": "domain_shards", "dataset": {"shard_dir": str(math_shards), "max_seq_len": 128}, "oversampling": 2.0}
    batch = next(iter(build_dataloader(loader, tokenizer, 2).dataloader))
    labels, ids = batch["labels"], batch["input_ids"]
    assert labels.shape == ids.shape == (4, 128)
    for row in range(4):
        targets = (labels[row] != -100).nonzero().flatten()
        # The prompt is masked: the first target comes after the row's first token, and targets are the row's tokens.
        assert 0 < int(targets[0]) and bool((labels[row][targets] == ids[row][targets]).all())


def test_the_eval_loader_reads_only_the_held_out_part(dolma_shards, tmp_path):
    from llmfoundry.data.dataloader import build_dataloader
    from transformers import AutoTokenizer

    from pipeline.dataset import DomainStreamingDataset
    from pipeline.holdout import heldout_subset

    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "assets" / "tokenizer")
    cfg = foundry.complete_config(_tiny(dolma_shards, tmp_path))
    loader = build_dataloader(cfg["eval_loader"], tokenizer, 4).dataloader
    seen = sorted(int(i) for b in loader for i in b["sample_id"])
    expected = heldout_subset(DomainStreamingDataset(shard_dir=str(dolma_shards), split="val"), 0.5, what="test")
    assert seen == sorted(int(expected[i]["sample_id"]) for i in range(len(expected)))
    assert 0 < len(seen) < len(DomainStreamingDataset(shard_dir=str(dolma_shards), split="val"))


# ---------------------------------------------------------------------------- bad options
BAD = [
    "algorithms.data_selection.oversamplin=3",
    "algorithms.data_selection.features.proj_dimm=8",
    "algorithms.data_selection.strategy=partitionsell",
    "algorithms.data_selection.interval=0",
    "callbacks.mixture_monitor.log_ids=true",
]


def test_a_bad_option_is_reported_with_its_yaml_path_before_anything_is_built(dolma_shards, tmp_path, monkeypatch):
    import importlib

    train_module = importlib.import_module("llmfoundry.command_utils.train")  # the package exports train()

    def reached(*args, **kwargs):
        raise AssertionError("built something before the config was checked")

    for name in ("build_tokenizer", "build_dataloader", "build_composer_model", "build_algorithm", "build_callback"):
        monkeypatch.setattr(train_module, name, reached)
    with pytest.raises(ConfigError) as info:
        train_module.train(OmegaConf.create(_tiny(dolma_shards, tmp_path, *BAD)))
    foundry_lines = {line.strip() for line in str(info.value).splitlines()[1:]}

    # train.py reports the same component problems, line for line, for the same keys.
    with pytest.raises(ConfigError) as info_train_py:
        load_run_config(TINY_TRAIN_PY, [*BAD, "callbacks.mixture_monitor={log_ids: true}"])
    train_py_lines = {line.strip() for line in str(info_train_py.value).splitlines()[1:]}
    assert foundry_lines == train_py_lines
    for key in ("algorithms.data_selection.oversamplin", "algorithms.data_selection.features.proj_dimm",
                "algorithms.data_selection.strategy", "algorithms.data_selection.interval",
                "callbacks.mixture_monitor.log_ids"):
        assert any(line.startswith(f"- {key}") for line in foundry_lines), (key, foundry_lines)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algorithms.data_selection.weighted_loss=true", "algorithms.data_selection.weighted_loss: llm-foundry's models"),
        ("train_loader.name=text", "algorithms.data_selection needs train_loader.name: domain_shards"),
        ("train_loader.oversampling=2", "train_loader.oversampling: unknown key"),
        ("train_loader.dataset.shard_dirr=x", "train_loader.dataset.shard_dirr: unknown key"),
        ("eval_loader.dataset.guide_fraction=0.25", "eval_loader.dataset.guide_fraction 0.25 is below"),
        ("max_duration=640sp", "max_duration '640sp': use ba or ep"),
    ],
)
def test_what_cannot_work_under_llm_foundry_is_reported(override, expected, dolma_shards, tmp_path):
    with pytest.raises(ConfigError, match="invalid configuration") as info:
        foundry.complete_config(_tiny(dolma_shards, tmp_path, override))
    assert expected in str(info.value)


# ---------------------------------------------------------------------------- end to end
def _llmfoundry_train(shard_dir: Path, run_dir: Path, *overrides: str) -> str:
    cmd = [
        str(LLMFOUNDRY),
        "train",
        str(TINY),
        f"variables.shard_dir={shard_dir}",
        f"variables.max_seq_len={SEQ_LEN}",
        f"save_folder={run_dir}",
        "console_log_interval=1ba",
        "python_log_level=warning",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def foundry_run(dolma_shards, tmp_path_factory):
    """`llmfoundry train yamls/foundry/tiny.yaml` for 20 steps on CPU, a checkpoint at step 10."""
    run_dir = tmp_path_factory.mktemp("foundry") / "run"
    output = _llmfoundry_train(dolma_shards, run_dir)
    return run_dir, output


@pytest.mark.timeout(900)
def test_llmfoundry_train_runs_20_steps_with_selection(foundry_run):
    run_dir, output = foundry_run
    hashes = _hashes(run_dir)
    assert sorted(hashes) == list(range(STEPS))  # Composer's batch index of each step
    assert len(set(hashes.values())) == STEPS  # a selection every step
    assert f"[batch={STEPS}/{STEPS}]" in output
    assert (run_dir / "mixture.json").exists() and (run_dir / "ep0-ba10-rank0.pt").exists()


@pytest.mark.timeout(900)
def test_selections_equal_train_pys_on_the_same_shards_seed_and_settings(foundry_run, dolma_shards, tmp_path):
    import train

    run_dir, _ = foundry_run
    cfg = load_run_config(
        TINY_TRAIN_PY,
        [
            f"variables.shard_dir={dolma_shards}",
            f"variables.max_seq_len={SEQ_LEN}",
            f"save_folder={tmp_path / 'train_py'}",
            "eval_loader=null",
            f"max_duration={STEPS}ba",
            "python_log_level=warning",
        ],
    )
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    ours, theirs = _hashes(tmp_path / "train_py"), _hashes(run_dir)
    assert len(ours) == STEPS
    assert theirs == ours


@pytest.mark.timeout(900)
def test_resume_from_a_mid_run_checkpoint_is_exact(foundry_run, dolma_shards, tmp_path):
    run_dir, _ = foundry_run
    resumed_dir = tmp_path / "resumed"
    _llmfoundry_train(dolma_shards, resumed_dir, f"load_path={run_dir / 'ep0-ba10-rank0.pt'}")
    full, resumed = _hashes(run_dir), _hashes(resumed_dir)
    assert sorted(resumed) == list(range(10, STEPS))
    assert resumed == {step: full[step] for step in resumed}


def _column(run_dir: Path, name: str) -> dict[int, str]:
    with open(run_dir / "selection_log.csv", newline="") as f:
        return {int(row["step"]): row[name] for row in csv.DictReader(f)}


@pytest.mark.timeout(900)
def test_select_ahead_under_llmfoundry_selects_as_under_train_py(dolma_shards, tmp_path):
    """`select_ahead: true` through llm-foundry's trainer: the next step's selection is made ahead from the second
    step on, and every step selects the rows train.py's run with select_ahead selects (same shards, seed, settings)."""
    import train

    ahead, steps = "algorithms.data_selection.select_ahead=true", 6
    run_dir = tmp_path / "foundry"
    _llmfoundry_train(dolma_shards, run_dir, ahead, f"max_duration={steps}ba")
    cfg = load_run_config(
        TINY_TRAIN_PY,
        [f"variables.shard_dir={dolma_shards}", f"variables.max_seq_len={SEQ_LEN}", f"save_folder={tmp_path / 'train_py'}",
         "eval_loader=null", f"max_duration={steps}ba", "python_log_level=warning", ahead],
    )
    trainer = train.build_trainer(cfg)
    trainer.fit()
    trainer.close()
    made = {step: float(v) for step, v in _column(run_dir, "made_ahead").items()}
    assert made == {0: 0.0, **{s: 1.0 for s in range(1, steps)}}
    ours, theirs = _hashes(tmp_path / "train_py"), _hashes(run_dir)
    assert len(ours) == steps and theirs == ours
