# The disk tier's native row reads (kernels/io/): a torch-free shared library, no fast-math.
ROWIO_LIB := build/kernels/libengram_io.so
ROWIO_SRC := kernels/io/engram_rowio.cpp

.PHONY: rowio
rowio: $(ROWIO_LIB)

$(ROWIO_LIB): $(ROWIO_SRC)
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -O2 -fPIC -shared -pthread -fno-fast-math -Wall -Wextra -Wl,-z,defs -o $@ $<

TEST_PREREQS += rowio
