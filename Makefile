# One place for the commands people and CI run.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-foundry demo test test-foundry test-all test-dist test-gpu lint bench clean

# Creates .venv/ (reused when present and up to date with pyproject.toml).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,eval]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

# Two pytest-xdist workers: the suite is mostly single-threaded Python (imports, small models), so on
# the 2-core machine CI runs on it takes about half the wall time of one process. TEST_WORKERS=0 runs it
# in this process (pytest's own -n 0), e.g. to debug one test.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-dist: $(STAMP)
	$(PY) -m pytest -q -m world_size

# The GPU suite (tests/gpu): skips each test with the reason on a machine without CUDA.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

# .venv-foundry/: llm-foundry 0.22 with this package and its entry points (pip install -e '.[test,foundry]';
# Streaming 0.12.x and transformers 4.51.x, the low ends of this project's ranges). Reused when present
# and up to date with pyproject.toml.
FOUNDRY_VENV ?= .venv-foundry
FOUNDRY_PY := $(FOUNDRY_VENV)/bin/python
FOUNDRY_STAMP := $(FOUNDRY_VENV)/.installed

$(FOUNDRY_STAMP): pyproject.toml
	test -x $(FOUNDRY_PY) || python3 -m venv $(FOUNDRY_VENV)
	$(FOUNDRY_PY) -m pip install -q --upgrade pip
	$(FOUNDRY_PY) -m pip install -q -e '.[test,foundry]'
	touch $(FOUNDRY_STAMP)

setup-foundry: $(FOUNDRY_STAMP)

# The plugin's tests (`llmfoundry train` end to end) and the project's Streaming-facing tests (MDS writing and
# reading, shared memory, resumption, the pinned selections), in .venv-foundry.
FOUNDRY_TESTS := tests/foundry tests/data/test_roundtrip.py tests/data/test_corpora.py \
	tests/data/test_determinism.py tests/data/test_manifest_tokenizer.py tests/data/test_shard_errors.py \
	tests/data/test_shard_robustness.py tests/data/test_shard_disk_full.py tests/data/test_faults_shard.py \
	tests/doremi/test_pipeline.py tests/training/test_holdout.py tests/training/test_infra.py \
	tests/training/test_faults.py tests/training/test_selected_ids.py tests/training/test_resume.py \
	tests/training/test_selection_pins.py

test-foundry: $(FOUNDRY_STAMP)
	$(FOUNDRY_PY) -m pytest -q $(FOUNDRY_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf build *.egg-info .pytest_cache demo_out
