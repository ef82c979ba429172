"""Every yaml parses and validates; config errors list every problem with field names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeline.config import ConfigError, TrainConfig, load_config
from tests.common.paths import REPO_ROOT, require_shared_data

# train.py's yamls; yamls/foundry/ holds llm-foundry's format (checked in tests/foundry under llm-foundry).
YAMLS = sorted(p for p in (REPO_ROOT / "yamls").rglob("*.yaml") if "foundry" not in p.relative_to(REPO_ROOT).parts)


def test_there_are_yamls():
    names = {p.name for p in YAMLS}
    assert {"llama1b_dolma.yaml", "qwen2.5-3b_metamathqa.yaml", "qwen2.5-3b_mol_instructions.yaml"} <= names


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_yaml_parses_and_validates(path: Path):
    if "../shared/" in path.read_text():  # a recipe on the real files beside the checkout (the SmolLM2 GGUF)
        require_shared_data()
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    assert cfg.global_train_batch_size > 0
    assert cfg.max_duration.endswith(("ba", "ep"))


def test_paper_recipes_are_encoded():
    # The pretraining recipe is a production shape (issue 22.6): 2048-token rows, about a million
    # tokens a step, warm-up then decay to its end, scoring on windows.
    pre = load_config(REPO_ROOT / "yamls" / "llama1b_dolma.yaml")
    assert pre.max_seq_len == 2048 and pre.max_seq_len * pre.global_train_batch_size == 2**20
    assert pre.optimizer.lr == pytest.approx(4e-4) and pre.scheduler.t_warmup == "2000ba"
    assert pre.scheduler.name == "cosine_with_warmup" and pre.max_duration == "24000ba"
    assert pre.model.config is not None and pre.model.config["hidden_size"] == 2048
    # The window the ghpile study supports (docs/results/study_ghpile.md): the first 64 tokens.
    features = pre.algorithms["data_selection"]["features"]
    assert (features["score_window"], features["score_window_position"]) == (64, "start")
    math = load_config(REPO_ROOT / "yamls" / "qwen2.5-3b_metamathqa.yaml")
    assert math.model.lora is not None and (math.model.lora.r, math.model.lora.alpha) == (16, 96)
    assert math.model.lora.dropout == pytest.approx(0.05)
    assert math.optimizer.lr == pytest.approx(2e-5) and math.scheduler.name == "cosine_with_warmup"
    assert math.max_duration == "2048ba"
    sel = math.algorithms["data_selection"]
    assert math.global_train_batch_size * sel["oversampling"] == 128
    mol = load_config(REPO_ROOT / "yamls" / "qwen2.5-3b_mol_instructions.yaml")
    assert mol.optimizer.lr == pytest.approx(2e-4) and mol.max_duration == "1024ba"


def test_overrides_apply(tmp_path):
    cfg = load_config(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml", ["optimizer.lr=0.5", "max_duration=7ba"])
    assert cfg.optimizer.lr == 0.5 and cfg.max_duration == "7ba"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        # YAML reads `{strategy:random}` as the key "strategy:random" with no value: unknown field, or unnoticed.
        ("algorithms.data_selection={strategy:random}", "'strategy:random' as one key without a value; a mapping "
         "needs a space after each colon (strategy: random)"),
        ("variables.extra={a: 1, b:2}", "(b: 2)"),
        ("optimizer.lr=[1,2", "its value is not valid YAML (while parsing a flow sequence"),
        ("optimizer.lr='x", "its value is not valid YAML (while scanning a quoted scalar"),
    ],
)
def test_an_override_yaml_cannot_read_or_reads_as_a_key_with_a_colon_is_named(override, says):
    """A second new-user review: such overrides raised yaml's scanner errors (`found character that cannot start
    any token`, naming no override), or became a key with a colon in it."""
    path = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path, ["optimizer.lr=0.5", override])
    msg = str(info.value)
    assert msg.startswith(f"{path}: override {override!r}: "), msg
    assert says in msg, msg
    cfg = load_config(path, ["optimizer.lr=0.5", "variables.shard_dir='a:b'", "run_name=http://x"])
    assert (cfg.optimizer.lr, cfg.train_loader.dataset.shard_dir, cfg.run_name) == (0.5, "a:b", "http://x")


def test_an_override_of_a_variable_nothing_reads_is_refused_with_the_near_one():
    """A new-user review: `variables.shard_dirr=/path` was accepted and the run read the yaml's default shards."""
    path = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path, ["variables.shard_dirr=/data/shards"])
    assert str(info.value) == (f"{path}: override variables.shard_dirr: nothing in the config reads "
                               "${variables.shard_dirr} (did you mean variables.shard_dir?)")
    with pytest.raises(ConfigError, match=r"the yaml's variables: shard_dir, max_seq_len$"):
        load_config(path, ["variables.zzz=1"])
    assert load_config(path, ["variables.max_seq_len=64"]).max_seq_len == 64


def test_unknown_and_missing_keys_are_all_listed(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "max_seq_len: 16\nmodel: {config: {model_type: llama}, lora_rank: 3}\n"
        "train_loader: {dataset: {shard_dir: x, shufle: true}}\nmax_duration: 5ba\nlearning_rate: 1\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    msg = str(info.value)
    for needle in ("lora_rank", "shufle", "learning_rate", "tokenizer_name", "global_train_batch_size"):
        assert needle in msg


def test_bad_values_name_field_and_value(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(
            REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml",
            ["max_duration=100sp", "optimizer.lr=-1", "scheduler.name=step", "model.lora.r=0"],
        )
    msg = str(info.value)
    assert "100sp" in msg and "optimizer.lr" in msg and "'step'" in msg
    with pytest.raises(ConfigError, match="global_train_batch_size"):
        load_config(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml", ["global_train_batch_size=abc"])
    # A number where a duration is meant is told what a duration needs, not only "expected str" (a new-user
    # review); a number for a text field is refused, not read as text: the yaml has made 007 of it 7.
    with pytest.raises(ConfigError, match=r"max_duration has the wrong type: got 3, expected str \(a duration has a "
                                          r"unit: 3ba, 3ep"):
        load_config(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml", ["max_duration=3"])
    with pytest.raises(ConfigError, match=r"run_name has the wrong type: got 7, .*quote it to give it as text"):
        load_config(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml", ["run_name=007"])
    assert load_config(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml", ["run_name='007'"]).run_name == "007"


def test_missing_yaml_file():
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config("nope.yaml")


# ---------------------------------------------------------------------------- typed components (issue 11.3)
TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
SEL = "algorithms.data_selection"


def load_run_config(*args, **kwargs):
    from composer_algos.registry import load_run_config

    return load_run_config(*args, **kwargs)


@pytest.fixture
def nothing_is_built(monkeypatch):
    """Make every heavy build step raise, so a test proves config errors come before them."""
    import composer_algos.models.causal_lm
    import pipeline.loaders
    import pipeline.manifest
    import pipeline.tokenizer

    def reached(*args, **kwargs):
        raise AssertionError("a tokenizer, manifest, dataset or model was built before the config was checked")

    monkeypatch.setattr(pipeline.tokenizer, "load_tokenizer", reached)
    monkeypatch.setattr(pipeline.manifest, "load_manifest", reached)
    monkeypatch.setattr(pipeline.loaders, "build_train_dataloader", reached)
    monkeypatch.setattr(composer_algos.models.causal_lm, "build_causal_lm", reached)


def test_selection_typos_bad_values_and_unknown_strategy_fail_together_before_anything_is_built(
    nothing_is_built, capsys
):
    import train

    overrides = [
        f"{SEL}.strategy=partitionsell",  # unknown strategy
        f"{SEL}.oversampeling=2",  # typo under data_selection
        f"{SEL}.features.proj_dimm=8",  # typo under features
        f"{SEL}.features.chunk_size=0",  # bad value (GradFeatureExtractor's rule)
        f"{SEL}.strategy_options.partitionsel.refitt=exact",  # typo under strategy_options
        f"{SEL}.strategy_options.partitionsel.ridge=5",  # bad value (PartitionSelOptions' rule)
        f"{SEL}.validation.batch_sise=3",  # typo under validation
        f"{SEL}.scope=everywhere",  # bad value (DataSelection's rule)
    ]
    with pytest.raises(SystemExit) as exit_info:
        train.main([str(TINY), *overrides])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in (
        f"{SEL}.strategy",
        "partitionsell",
        f"{SEL}.oversampeling",
        f"{SEL}.features.proj_dimm",
        f"{SEL}.features.chunk_size",
        f"{SEL}.strategy_options.partitionsel.refitt",
        f"{SEL}.strategy_options.partitionsel.ridge",
        f"{SEL}.validation.batch_sise",
        "everywhere",
    ):
        assert needle in err, f"{needle!r} missing from:\n{err}"


def test_unknown_keys_list_what_is_allowed_derived_from_the_code():
    import inspect

    from composer_algos.features import GradFeatureExtractor
    from composer_algos.selection import PartitionSelOptions

    with pytest.raises(ConfigError) as info:
        load_run_config(TINY, [f"{SEL}.features.proj_dimm=8", f"{SEL}.strategy_options.iwd.pik=greedy"])
    lines = str(info.value).splitlines()
    feat_line = next(line for line in lines if "features.proj_dimm" in line)
    for name in inspect.signature(GradFeatureExtractor).parameters:
        if name not in ("model", "seed"):  # the model is the run's; the seed is the algorithm's
            assert name in feat_line, f"{name} not offered in {feat_line!r}"
    opt_line = next(line for line in lines if "strategy_options.iwd.pik" in line)
    for f in dataclasses.fields(PartitionSelOptions):
        assert f.name in opt_line


def test_strategy_options_keyed_by_a_non_strategy_and_the_wrong_type_are_reported():
    with pytest.raises(ConfigError) as info:
        load_run_config(TINY, [f"{SEL}.strategy_options.partitionsell.refit=exact", f"{SEL}.interval=often"])
    msg = str(info.value)
    assert f"{SEL}.strategy_options.partitionsell" in msg and "partitionsel" in msg
    assert f"{SEL}.interval" in msg and "'often'" in msg


def test_the_selection_config_is_typed_frozen_and_defaults_come_from_the_algorithm():
    import inspect

    from composer_algos.data_selection.algorithm import DataSelection

    cfg = load_run_config(TINY)
    sel = cfg.algorithms["data_selection"]
    assert dataclasses.is_dataclass(sel) and dataclasses.is_dataclass(sel.features)
    assert sel.strategy == "partitionsel" and sel.features.proj_dim == 64 and sel.validation.batch_size == 4
    assert sel.strategy_options["partitionsel"].refit == "exact"
    # Omitted keys read as the algorithm's own defaults: one owner per default.
    for name in ("scope", "interval", "weighted_loss", "start", "end"):
        assert getattr(sel, name) == inspect.signature(DataSelection).parameters[name].default
    with pytest.raises(dataclasses.FrozenInstanceError):
        sel.strategy = "random"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_seq_len = 3  # type: ignore[misc]
    # Building passes exactly the keys the yaml gave (so the built algorithm is the one the yaml describes).
    assert dict(dict(sel)["features"]) == {"last_n_blocks": 1, "normalization": "adam_optimizer", "proj_dim": 64}


def test_missing_yaml_and_config_errors_exit_2_with_one_message(tmp_path, capsys):
    import train

    with pytest.raises(SystemExit) as info:
        train.main([str(tmp_path / "nope.yaml")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "nope.yaml" in err and "Traceback" not in err


def test_a_config_loaded_without_the_registry_is_checked_before_build_trainer_builds_anything(nothing_is_built):
    import train

    cfg = load_config(TINY, [f"{SEL}.features.proj_dimm=8", "callbacks.speed_monitr.window_size=3"])
    assert isinstance(cfg.algorithms["data_selection"], dict)  # the data side alone leaves them untyped
    with pytest.raises(ConfigError) as info:
        train.build_trainer(cfg)
    assert f"{SEL}.features.proj_dimm" in str(info.value) and "callbacks.speed_monitr" in str(info.value)


def test_average_beta_with_a_preconditioned_validation_side_is_reported_with_both_yaml_paths():
    with pytest.raises(ConfigError) as info:
        load_run_config(TINY, [f"{SEL}.validation.average_beta=0.9", f"{SEL}.features.precondition=both"])
    msg = str(info.value)
    assert f"{SEL}: validation.average_beta 0.9" in msg and "features.precondition 'both'" in msg
    load_run_config(TINY, [f"{SEL}.validation.average_beta=0.9", f"{SEL}.features.precondition=pool"])


def test_a_tilde_override_removes_a_key_and_a_missing_one_is_an_error(tmp_path):
    from omegaconf import OmegaConf

    yaml = tmp_path / "run.yaml"
    data = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"))
    data.setdefault("callbacks", {})["speed_monitor"] = {"window_size": 5}
    OmegaConf.save(OmegaConf.create(data), yaml)
    assert "speed_monitor" in load_config(yaml).callbacks
    cfg = load_config(yaml, ["~callbacks.speed_monitor", "max_duration=3ba"])
    assert "speed_monitor" not in cfg.callbacks and cfg.max_duration == "3ba"
    with pytest.raises(ConfigError, match="no key 'callbacks.nosuch'"):
        load_config(yaml, ["~callbacks.nosuch"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(yaml, ["max_duration"])


def test_fsdp_config_typos_bad_strategies_and_a_hybrid_without_replicas_are_reported_before_build():
    # Composer builds FSDPConfig only in the Trainer (an unknown key: a bare TypeError after the model is built), and
    # runs HYBRID_SHARD on a one-dimensional mesh as FULL_SHARD over every rank with only a warning.
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["fsdp_config={sharding_stratgy: FULL_SHARD, use_orig_params: true}"])
    assert "fsdp_config.sharding_stratgy" in str(info.value) and "did you mean sharding_strategy" in str(info.value)
    with pytest.raises(ConfigError, match="fsdp_config.sharding_strategy must be one of .*got 'HALF_SHARD'"):
        load_config(TINY, ["fsdp_config={sharding_strategy: HALF_SHARD}"])
    for strategy, fallback in (("HYBRID_SHARD", "FULL_SHARD"), ("_hybrid_shard_zero2", "SHARD_GRAD_OP")):
        with pytest.raises(ConfigError) as info:
            load_config(TINY, [f"fsdp_config={{sharding_strategy: {strategy}}}"])
        msg = str(info.value)
        assert "data_parallel_replicate_degree" in msg and f"Composer runs {fallback} over every rank" in msg, msg
    ok = load_config(TINY, ["fsdp_config={sharding_strategy: HYBRID_SHARD, data_parallel_replicate_degree: 2}"])
    assert ok.fsdp_config["data_parallel_replicate_degree"] == 2
    assert load_config(TINY, ["fsdp_config={sharding_strategy: full_shard}"]).fsdp_config is not None


def test_shards_of_another_tokenizer_are_refused_before_the_loaders_and_the_model_are_built(
    corpus_dir, dolma_shards, tmp_path, monkeypatch
):
    # Found by a new-user review: dm_math shards (SmolLM2's 49152 ids) under the tiny yaml's 4096-token tokenizer
    # built everything, then failed inside torch.embedding with "index out of range in self".
    import shard as shard_tool

    import composer_algos.models.causal_lm
    import pipeline.loaders
    import train
    from composer_algos.registry import load_run_config
    from pipeline.manifest import load_manifest, tokenizer_mismatch
    from pipeline.tokenizer import load_tokenizer
    from tests.data.mds_helpers import load_tool
    from tests.training.conftest import SEQ_LEN, tiny_overrides

    other = tmp_path / "other_tokenizer"
    assert load_tool("train_tokenizer").main(["--out", str(other), "--vocab-size", "400", "--scale", "0.03"]) == 0
    shards = tmp_path / "shards"
    assert shard_tool.main(["dolma", str(corpus_dir / "dolma" / "documents"), "--out", str(shards), "--tokenizer",
                            str(other), "--max-seq-len", str(SEQ_LEN), "--val-count", "8", "--no-progress"]) == 0

    def reached(*args, **kwargs):
        raise AssertionError("a loader or the model was built before the shards' tokenizer was checked")

    monkeypatch.setattr(pipeline.loaders, "train_dataloader_from_config", reached)
    monkeypatch.setattr(composer_algos.models.causal_lm, "build_causal_lm", reached)
    cfg = load_run_config(TINY, tiny_overrides(shards, tmp_path / "run"))
    with pytest.raises(ValueError) as info:
        train.build_trainer(cfg)
    msg = str(info.value)
    # The run's tokenizer is the larger (4096 ids): the shards' ids fit it, and it would read them as other tokens.
    assert f"tokenizer_name 'assets/tokenizer' is not the tokenizer the shards in {shards} were written with " \
           f"({str(other)!r}): its ids 0-399 are other tokens than the shards'" in msg, msg
    assert tokenizer_mismatch(load_manifest(shards), load_tokenizer(other), str(other)) is None
    # The guide's shards kept apart: the run's tokenizer (400 ids) cannot hold the demo tokenizer's.
    cfg = load_run_config(TINY, tiny_overrides(shards, tmp_path / "run2", f"tokenizer_name={other}",
                                               f"{SEL}.validation.shard_dir={dolma_shards}"))
    with pytest.raises(ValueError, match=rf"^{SEL}.validation.shard_dir: tokenizer_name .* is not the tokenizer the "
                                         r"shards .*: vocabulary 400, smaller than the shards' 4096"):
        train.build_trainer(cfg)


def test_a_missing_shard_directory_or_tokenizer_is_one_line_and_exit_2(dolma_shards, tmp_path, capsys):
    # They were tracebacks from build_trainer (found by a new-user review); nothing is built before them.
    import train

    for overrides, expected in (
        ([f"variables.shard_dir={tmp_path / 'nope'}"], "train_loader.dataset.shard_dir: "),
        ([f"variables.shard_dir={dolma_shards}", f"tokenizer_name={tmp_path / 'no_tokenizer'}"], "no_tokenizer': no such directory"),
    ):
        with pytest.raises(SystemExit) as info:
            train.main([str(TINY), *overrides, "save_folder=null"])
        err = capsys.readouterr().err
        assert info.value.code == 2 and expected in err and "Traceback" not in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU's refusal")
def test_a_zero_validation_batch_and_auto_microbatches_on_the_cpu_are_refused_before_anything_is_built(
    nothing_is_built,
):
    # Both came after the model was built: the first at fit's start as a traceback (a new-user review).
    import train

    with pytest.raises(ConfigError, match="validation.batch_size must be an integer > 0, got 0"):
        load_run_config(TINY, [f"{SEL}.validation.batch_size=0"])
    cfg = load_run_config(TINY, ["device_train_microbatch_size=auto"])
    with pytest.raises(ConfigError, match="device_train_microbatch_size: auto needs a GPU"):
        train.build_trainer(cfg)


def test_doremi_on_a_subset_of_the_shards_domains_is_refused_before_anything_is_built(dolma_shards, tmp_path):
    # It learnt weights for the domains it never streamed (58% of the mass on three unseen domains), and stage
    # (c) then refused its file (a second new-user review).
    import train

    proxy = REPO_ROOT / "yamls" / "doremi" / "demo_proxy.yaml"
    cfg = load_run_config(proxy, [f"variables.shard_dir={dolma_shards}", f"variables.runs={tmp_path}",
                                  "max_seq_len=64", "train_loader.dataset.domains=[wiki, spam]"])  # the shards' length
    with pytest.raises(ConfigError, match=r"algorithms.doremi learns a weight for every domain of the shards .*"
                                          r"streams only \['wiki', 'spam'\]"):
        train.build_trainer(cfg)


@pytest.mark.parametrize(
    ("name", "weight_decay", "says"),
    [
        # torch's AdamW: x(1 - lr wd) a step. The 1B recipe had 250 (x0.9 a step at lr 4e-4) until a review.
        ("adamw", 250.0, "decays every weight by 10% a step at the peak lr (at most 5% is allowed); the usual weight "
         "decay 0.1 is 0.1 here"),
        # Composer's DecoupledAdamW: x(1 - (lr / initial lr) wd), so its 0.1 is 10% a step too.
        ("decoupled_adamw", 0.1, "by 10% a step at the peak lr (at most 5% is allowed); the usual weight decay 0.1 is "
         "4e-05 (0.1 x lr) here"),
    ],
)
def test_a_weight_decay_that_erases_the_weights_is_refused_and_the_usual_value_named(name, weight_decay, says):
    path = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
    with pytest.raises(ConfigError, match="optimizer.weight_decay") as info:
        load_config(path, [f"optimizer.name={name}", "optimizer.lr=4e-4", f"optimizer.weight_decay={weight_decay}"])
    assert says in str(info.value), str(info.value)
    usual = 0.1 if name == "adamw" else 4e-5
    cfg = load_config(path, [f"optimizer.name={name}", "optimizer.lr=4e-4", f"optimizer.weight_decay={usual}"])
    assert cfg.optimizer.weight_decay == usual


def test_the_1b_recipes_decay_as_the_references_weight_decay_of_0_1():
    """Torch's AdamW at 0.1 and Composer's DecoupledAdamW at 0.1 x lr: the same update, 4e-5 a step at the peak."""
    import yaml

    ours = load_config(REPO_ROOT / "yamls" / "llama1b_dolma.yaml").optimizer
    foundry = yaml.safe_load((REPO_ROOT / "yamls" / "foundry" / "llama1b_dolma.yaml").read_text())["optimizer"]
    assert (ours.name, ours.weight_decay) == ("adamw", 0.1)
    assert foundry["name"] == "decoupled_adamw"
    assert foundry["weight_decay"] == pytest.approx(0.1 * ours.lr) and foundry["lr"] == ours.lr


def test_shard_settings_the_data_refutes_are_one_line_errors_before_the_model_is_built(dolma_shards, tmp_path, capsys,
                                                                                      no_streaming_cleanup):
    """A new-user review: these raised tracebacks after the tokenizer, or after the model at the Trainer's start."""
    import train
    from tests.training.conftest import tiny_overrides

    tiny = str(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml")
    cases = [
        ("variables.max_seq_len=32", "max_seq_len 32 does not match the shards of train_loader.dataset.shard_dir"),
        ("train_loader.dataset.domains=[reddit,nosuch]", "train_loader.dataset: domains ['nosuch'] are not in the shard"),
        (f"eval_loader.shard_dir={tmp_path / 'nowhere'}", f"eval_loader.shard_dir: {tmp_path / 'nowhere'} holds no manifest.json"),
        (f"algorithms.data_selection.validation.shard_dir={tmp_path / 'nowhere'}",
         "algorithms.data_selection.validation.shard_dir: "),
        ("eval_loader.device_eval_batch_size=0", "eval_loader.device_eval_batch_size must be > 0, got 0"),
    ]
    for override, says in cases:
        with pytest.raises(SystemExit) as info:
            train.main([tiny, *tiny_overrides(dolma_shards, tmp_path / "run"), override])
        err = capsys.readouterr().err
        assert info.value.code == 2 and says in err and "Traceback" not in err, (override, err[-800:])


def test_a_model_config_key_the_model_type_lacks_is_refused_with_the_near_one(dolma_shards, tmp_path, capsys,
                                                                               no_streaming_cleanup):
    """A new-user review: `model.config.hidden_sizee=32` was kept by transformers as a stray attribute and the model
    trained at the default width."""
    import train
    from tests.training.conftest import tiny_overrides

    tiny = str(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml")
    with pytest.raises(SystemExit) as info:
        train.main([tiny, *tiny_overrides(dolma_shards, tmp_path / "run"), "model.config.hidden_sizee=32"])
    err = capsys.readouterr().err
    assert info.value.code == 2, err[-500:]
    assert ("model.config: ['hidden_sizee'] are not settings of a llama config (did you mean 'hidden_sizee' -> "
            "'hidden_size'?)") in err, err[-500:]


def test_an_unknown_key_names_the_near_one():
    # A new-user review: `stratgy` listed the allowed keys without pointing at `strategy`.
    path = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
    with pytest.raises(ConfigError) as info:
        load_run_config(path, ["algorithms.data_selection.stratgy=random", "optimizer.lrr=1"])
    msg = str(info.value)
    assert "algorithms.data_selection.stratgy: unknown key (did you mean 'strategy'?); allowed: [" in msg, msg
    assert "optimizer.lrr: unknown key (did you mean 'lr'?)" in msg, msg


def test_select_ahead_with_automatic_microbatches_on_several_ranks_is_refused_before_the_loaders(dolma_shards, tmp_path,
                                                                                               monkeypatch):
    """A new-user review: DataSelection refused it only when the Trainer started, after the loaders and the model."""
    import torch
    from composer.utils import dist

    import pipeline.loaders
    import train
    from tests.training.conftest import tiny_overrides

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # `auto` needs a GPU: pass that check
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(pipeline.loaders, "train_dataloader_from_config", lambda *a, **k: pytest.fail("loaders built"))
    cfg = load_run_config(REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml", [
        *tiny_overrides(dolma_shards, tmp_path / "run"), "device_train_microbatch_size=auto",
        "algorithms.data_selection.select_ahead=true"])
    with pytest.raises(ConfigError, match="select_ahead: true is not supported with device_train_microbatch_size: auto on 2 ranks"):
        train.build_trainer(cfg)
