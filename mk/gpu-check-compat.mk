# `make gpu-check-compat`: the dry run of bench/gpu_check.py under what the lent GPU machine has
# (Python 3.12, PyPI's torch==2.11.0, the CUDA build, which runs on the CPU; numpy, safetensors,
# xxhash, tqdm, prometheus-client, matplotlib, pytest; no SGLang), so that the check cannot lean on the dev venv's
# newer torch. Not run by `make test`: the first run downloads ~3 GB of wheels. The venv is built
# once from pyenv's 3.12 (COMPAT_PYTHON) in build/venv-compat.
COMPAT_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3 /opt/pyenv/versions/3.12*/bin/python3))
COMPAT_VENV ?= build/venv-compat
COMPAT_TORCH ?= 2.11.0
# What the lent machine has besides torch (its Triton comes with torch).
COMPAT_PACKAGES ?= numpy safetensors xxhash tqdm prometheus-client matplotlib pytest
COMPAT_STAMP = $(COMPAT_VENV)/.ready-torch-$(COMPAT_TORCH)-$(shell echo $(COMPAT_PACKAGES) | cksum | cut -d' ' -f1)

.PHONY: gpu-check-compat
gpu-check-compat: $(COMPAT_STAMP)
	@$(MAKE) --no-print-directory kernels VENDOR=cpu
	@PYTHONPATH=. $(COMPAT_VENV)/bin/python -c 'import sys, torch; from bench.gpu_check_preflight import still_newer; \
	  have = still_newer(torch); print(f"torch {torch.__version__}: {len(have)} of the APIs listed as newer than 2.11 exist" \
	  + (": " + ", ".join(have) + " (take them off NEWER_THAN_2_11)" if have else "")); sys.exit(bool(have))'
	OUT=$${OUT:-bench/out/compat} PYTHONPATH=. $(COMPAT_VENV)/bin/python bench/gpu_check.py --dry-run $(GPU_CHECK_ARGS)

$(COMPAT_STAMP):
	@test -n "$(COMPAT_PYTHON)" || { echo "gpu-check-compat: no Python 3.12 under ~/.pyenv/versions or /opt/pyenv; set COMPAT_PYTHON=/path/to/python3.12"; exit 1; }
	test -x $(COMPAT_VENV)/bin/python || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install --quiet torch==$(COMPAT_TORCH) $(COMPAT_PACKAGES)
	touch $@
