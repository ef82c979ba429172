"""Host syncs of a selection step on CUDA, counted by torch itself (issue 31.1; the CPU emulation's ground truth).

`torch.cuda.set_sync_debug_mode("warn")` warns at every call that makes the host wait for the GPU;
tools/bench/step_audit.py counts them during one step of the tiny config in amp_bf16, attributed to the
project's call sites. The budget is tests/training/test_step_syncs.py's.
"""

from __future__ import annotations

import pytest
from step_audit import StepAuditor, format_counts
from stepping import prepare_for_stepping

import train
from pipeline.config import load_config
from tests.training.conftest import tiny_overrides
from tests.training.test_step_syncs import STRATEGIES, TINY, allowed_syncs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_selection_step_syncs_at_most_its_budget_on_cuda(cuda, strategy, dolma_shards, tmp_path):
    cfg = load_config(
        TINY,
        tiny_overrides(
            dolma_shards, tmp_path / strategy, "eval_loader=null", "device=gpu", "precision=amp_bf16",
            f"algorithms.data_selection.strategy={strategy}",
        ),
    )
    trainer = train.build_trainer(cfg)
    prepare_for_stepping(trainer)
    auditor = StepAuditor(trainer)
    trainer.fit(duration="1ba")
    trainer.fit(duration="1ba")
    counts = auditor.count()
    auditor.close()
    trainer.close()
    assert counts["how"] == "cuda"
    # torch's warnings carry the innermost frame, which may be torch's or transformers': all are counted.
    assert counts["sync"] <= allowed_syncs(strategy), format_counts(counts, top=40)
