# Fuzzing the parsers of files a user hands us (fuzz/): the table manifest and layer headers,
# the config loader, and `tables convert`'s checkpoint reading, coverage-guided by atheris
# (libFuzzer). The rule each harness checks: any input gives a result or one line naming the
# file (an EngramError; exit 2 in the CLI); a traceback, a hang or a blow-up is a finding.
# `make fuzz` runs every target for FUZZ_SECONDS from its seed corpus fuzz/corpus/TARGET; new
# inputs, logs and findings (crash-*, timeout-*) go to build/fuzz/TARGET/. `make test` runs
# short fixed-seed runs of the same and replays every regression case (tests/tools/test_fuzz.py).
FUZZ_SECONDS ?= 300
FUZZ_SEED ?= 1
FUZZ_TARGETS ?= tables config convert

.PHONY: fuzz
fuzz: setup
	$(PY) -m fuzz.runner --seconds $(FUZZ_SECONDS) --seed $(FUZZ_SEED) --out build/fuzz $(FUZZ_TARGETS)
