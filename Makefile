# One place for the commands people and CI run.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all test-dist test-gpu lint bench clean

# Creates .venv/ (reused when present and up to date with pyproject.toml).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,eval]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

test-dist: $(STAMP)
	$(PY) -m pytest -q -m world_size

# The GPU suite (tests/gpu): skips each test with the reason on a machine without CUDA.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf build *.egg-info .pytest_cache demo_out
