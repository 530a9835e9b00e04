# engram-sglang: `make demo` runs the built-in demo, `make test` runs the tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.engram-setup
PYTEST_ARGS ?=

.PHONY: setup demo test test-gpu clean
.DEFAULT_GOAL := test

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml requirements/constraints.txt requirements/sglang-cpu.txt requirements/dev.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $@

# Room-specific targets (kernels, lint, ...) live in mk/*.mk.
include $(wildcard mk/*.mk)

# The demo serves on the CPU: the host gather library and the disk tier's row reads.
demo: setup rowio
	@$(MAKE) --no-print-directory kernels VENDOR=cpu
	$(PY) -m engram_sglang.cli demo

test: setup $(TEST_PREREQS)
	$(PY) -m pytest $(PYTEST_ARGS)

test-gpu: setup $(TEST_PREREQS)
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

clean:
	rm -rf build .pytest_cache
