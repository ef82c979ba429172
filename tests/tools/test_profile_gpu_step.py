"""tools/bench/profile_gpu_step.py on the CPU (--smoke): the three arms profiled, their stage tables and traces."""

from __future__ import annotations

import profile_gpu_step  # noqa: E402
import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_profiles_three_arms_with_stage_tables_and_traces(tmp_path, capsys):
    assert profile_gpu_step.main(["--smoke", "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for arm in ("random", "partitionsel", "partitionsel+compiled"):
        assert f"===== {arm}: " in out
        assert (tmp_path / f"{arm}.json").stat().st_size > 0
    assert out.count("selection/features") >= 2  # the partitionsel arms score features; random does not
    assert "host wait: aten::item" in out


def test_steps_below_one_are_refused():
    with pytest.raises(SystemExit):
        profile_gpu_step.main(["--smoke", "--steps", "0"])
