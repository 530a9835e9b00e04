# The disk tier's native row reads (kernels/io/): a torch-free shared library, no fast-math.
# One name across source, binding and target: kernels/io/engram_rowio.cpp (its ABI in
# engram_rowio_abi.h), engram_sglang/core/stores/rowio.py, `make rowio`, libengram_rowio.so.
# The native step (one call per layer and step) and its DRAM-cache policy; on the CPU it decodes
# with the host gather's row decode (its AVX-512 one where the CPU has it). O_DIRECT reads by
# io_uring (raw syscalls, engram_uring.h), native AIO where io_uring is unavailable.
ROWIO_LIB := build/kernels/libengram_rowio.so
ROWIO_SRC := kernels/io/engram_rowio.cpp

.PHONY: rowio
rowio: $(ROWIO_LIB)

include kernels/host-flags.mk

# The headers it includes come from the compiler (KERNEL_DEPFLAGS, mk/kernels.mk: the .d beside it),
# not a list here; tests/kernels/test_native_abi.py checks that nativelibs.HOST_SOURCES names the same files.
$(ROWIO_LIB): $(ROWIO_SRC) kernels/host-flags.mk mk/rowio.mk
	@mkdir -p $(dir $@)
	$(CXX) $(ENGRAM_ROWIO_CXXFLAGS) $(KERNEL_DEPFLAGS) -shared -o $@ $<

-include $(ROWIO_LIB:.so=.d)

TEST_PREREQS += rowio
