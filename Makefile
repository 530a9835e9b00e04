# engram-sglang: `make demo` runs the built-in demo, `make test` runs the tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.engram-setup
PYTEST_ARGS ?=

.PHONY: setup demo test test-gpu gpu-check clean
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
	$(PY) -m engram_sglang.tools.cli demo

test: setup $(TEST_PREREQS)
	$(PY) -m pytest $(PYTEST_ARGS)

# The GPU images (CI): the gpu-marked tests with the image's SGLang, then the one GPU check.
test-gpu: setup $(TEST_PREREQS)
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory gpu-check

# The one command a lent GPU runs: the machine's python3, the package from this tree, the
# native libraries prebuilt in build/kernels (carried). No setup, toolchain or SGLang, on
# purpose: no prerequisites. Table on stdout, JSON in $OUT (default bench/out); exit 1 on
# any failure. GPU_CHECK_ARGS=--quick (<= 2 min), --dry-run (CPU parts), --list.
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=. python3 bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf build .pytest_cache
