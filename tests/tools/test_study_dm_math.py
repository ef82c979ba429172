"""tools/studies/study_dm_math.py: every ablation reaches train.py as a valid config; --ablations is checked."""

from __future__ import annotations

import pytest
import run_experiment  # noqa: E402
import study_dm_math  # noqa: E402


@pytest.mark.parametrize("name", list(study_dm_math.ABLATIONS))
def test_each_ablation_passes_through_the_variant_syntax_into_a_config(name):
    from composer_algos.registry import load_run_config

    text = ",".join([f"ps_{name}=partitionsel", *study_dm_math.ABLATIONS[name]])
    label, strategy, overrides = run_experiment.parse_variant(text)
    assert (label, strategy, overrides) == (f"ps_{name}", "partitionsel", study_dm_math.ABLATIONS[name])
    # The overrides must parse and differ from the yaml's settings (one setting changed).
    base = load_run_config(study_dm_math.YAML, []).algorithms["data_selection"]
    varied = load_run_config(study_dm_math.YAML, overrides).algorithms["data_selection"]
    assert varied != base


def test_unknown_ablation_names_are_rejected_with_the_allowed_list(capsys):
    with pytest.raises(SystemExit):
        study_dm_math.main(["--parts", "report", "--ablations", "prec_pool,bogus"])
    err = capsys.readouterr().err
    assert "bogus" in err and "prec_pool" in err and "weighted" in err
