# The disk tier's native row reads (kernels/io/): a torch-free shared library, no fast-math.
ROWIO_LIB := build/kernels/libengram_io.so
ROWIO_SRC := kernels/io/engram_rowio.cpp

.PHONY: rowio
rowio: $(ROWIO_LIB)

include kernels/host-flags.mk

$(ROWIO_LIB): $(ROWIO_SRC) kernels/host-flags.mk
	@mkdir -p $(dir $@)
	$(CXX) $(ENGRAM_IO_CXXFLAGS) -shared -o $@ $<

TEST_PREREQS += rowio
