# The soak under faults (bench/soak.py): `make soak` runs real SGLang servers (disk tier by
# O_DIRECT behind a DRAM row cache, then host placement) under 32 streaming clients for
# SOAK_MINUTES each, with EIO bursts and stalls injected below the native row reader by
# build/kernels/libengram_faults.so (an LD_PRELOAD library: kernels/io/engram_faults.c), plus
# ENOSPC on the stats/trace target, short reads, a frozen shared-copy lock holder and one
# out-of-range token id request per minute (bench/soak.py --classes).
# SOAK_ARGS passes more flags (e.g. --hard-faults once read errors are contained).
FAULTS_LIB := build/kernels/libengram_faults.so
SOAK_MINUTES ?= 10
SOAK_ARGS ?=

.PHONY: faults soak
faults: $(FAULTS_LIB)

$(FAULTS_LIB): kernels/io/engram_faults.c mk/soak.mk
	@mkdir -p $(dir $@)
	$(CC) -std=gnu11 -O2 -fPIC -shared -pthread -Wall -Wextra -Wl,-z,defs $(KERNEL_DEPFLAGS) -o $@ $< -ldl

-include $(FAULTS_LIB:.so=.d)

TEST_PREREQS += faults

soak: setup rowio faults
	@$(MAKE) --no-print-directory kernels VENDOR=cpu
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)
