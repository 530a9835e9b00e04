# The disk tier's native row reads (kernels/io/): a torch-free shared library, no fast-math.
ROWIO_LIB := build/kernels/libengram_io.so
ROWIO_SRC := kernels/io/engram_rowio.cpp
# The native step (one call per layer and step) and its DRAM-cache policy; on the CPU it decodes
# with the host gather's row decode (its AVX-512 one where the CPU has it). O_DIRECT reads by
# io_uring (raw syscalls, engram_uring.h), native AIO where io_uring is unavailable.
ROWIO_HEADERS := kernels/io/engram_disk_step.h kernels/io/engram_dram_policy.h kernels/common/engram_gather.h \
	kernels/common/engram_denormals.h kernels/io/engram_uring.h kernels/cpu/engram_decode_avx512.h

.PHONY: rowio
rowio: $(ROWIO_LIB)

include kernels/host-flags.mk

$(ROWIO_LIB): $(ROWIO_SRC) $(ROWIO_HEADERS) kernels/host-flags.mk mk/rowio.mk
	@mkdir -p $(dir $@)
	$(CXX) $(ENGRAM_IO_CXXFLAGS) -shared -o $@ $<

TEST_PREREQS += rowio
