"""tools/studies/gpu_study.sh's `stage`: the model's parts, carried one call at a time, joined and checked (issue 29.6).

The script runs in a scratch copy of the project layout, so the checkout's .g1-.g3 are never touched;
`GPU_STUDY_DATA` and `GPU_STUDY_SITE` point its outputs into the scratch folder (the stack counts as
installed). `pack` downloads wheels, so it is not run here.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.common.paths import REPO_ROOT, require_shared_data

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _project(tmp_path, model_bytes: bytes):
    proj = tmp_path / "proj"
    (proj / "tools" / "studies").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "tools" / "studies" / "gpu_study.sh", proj / "tools" / "studies")
    chunk = 24 << 20
    parts = [model_bytes[i : i + chunk] for i in range(0, len(model_bytes), chunk)]
    assert len(parts) == 4
    where = {0: ".g1", 1: ".g2", 2: ".g2", 3: ".g3"}
    for i, part in enumerate(parts):
        d = proj / where[i] / "model"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"part.{i:02d}").write_bytes(part)
    (proj / ".g1" / "dm_math").mkdir()
    (proj / ".g1" / "dm_math" / "train.json").write_text("[]")
    site = tmp_path / "site"
    site.mkdir()
    (site / ".installed").touch()
    env = dict(os.environ, GPU_STUDY_DATA=str(tmp_path / "data"), GPU_STUDY_SITE=str(site))
    return proj, env


def _stage(proj, env):
    return subprocess.run(["bash", "tools/studies/gpu_study.sh", "stage"], cwd=proj, env=env, capture_output=True, text=True)


def test_stage_joins_the_parts_as_they_arrive_and_checks_the_model(tmp_path):
    model = require_shared_data("smollm2", MODEL).read_bytes()
    proj, env = _project(tmp_path, model)
    aside = tmp_path / "aside"
    aside.mkdir()
    for g in (".g2", ".g3"):
        shutil.move(proj / g, aside / g)
    out = _stage(proj, env)
    assert out.returncode == 0 and "1 of the model's 4 parts" in out.stdout, out.stdout + out.stderr
    shutil.move(aside / ".g2", proj / ".g2")
    out = _stage(proj, env)
    assert out.returncode == 0 and "3 of the model's 4 parts" in out.stdout, out.stdout + out.stderr
    shutil.move(aside / ".g3", proj / ".g3")
    out = _stage(proj, env)
    assert out.returncode == 0 and "joined and checked" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "data" / "smollm2" / MODEL).read_bytes() == model
    assert (tmp_path / "data" / "dm_math" / "train.json").read_text() == "[]"


def test_a_corrupted_part_fails_the_check(tmp_path):
    model = bytearray(require_shared_data("smollm2", MODEL).read_bytes())
    model[1000] ^= 0xFF
    proj, env = _project(tmp_path, bytes(model))
    out = _stage(proj, env)
    assert out.returncode == 2 and "sha256 differs" in out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize("args, message", [(["bogus"], "usage"), (["run"], "OUT is not set")])
def test_bad_use_is_refused_with_the_reason(tmp_path, args, message):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    out = subprocess.run(["bash", "tools/studies/gpu_study.sh", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr
