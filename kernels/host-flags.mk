# The host libraries' compile flags, in one place: mk/kernels.mk and mk/rowio.mk include this
# file, and an installed wheel carries it beside the sources so that engram_sglang/core/nativelibs.py
# builds on first use with the same flags (it reads the `NAME := flags` lines below).
# No fast-math and no contraction (-ffp-contract=off): the decode must give the torch
# reference's bits.
ENGRAM_CPU_CXXFLAGS := -std=c++17 -O3 -fPIC -pthread -Wall -Wextra -fno-fast-math -ffp-contract=off
ENGRAM_ROWIO_CXXFLAGS := -std=c++17 -O2 -fPIC -pthread -fno-fast-math -Wall -Wextra -Wl,-z,defs
