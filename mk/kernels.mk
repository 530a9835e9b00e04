# Native gather kernels (kernels/): `make kernels` builds, without a GPU,
#   build/kernels/libengram_cpu.so   host library (g++)
#   build/kernels/libengram_cuda.so  sm_80, sm_89, sm_90, sm_100, sm_120 SASS + compute_120 PTX (nvcc),
#                                    on the shared CUDA runtime (the libcudart torch loads)
#   build/kernels/libengram_hip.so   gfx942 + gfx950 code objects (clang 22)
# both from one launcher source, kernels/cuda/engram_gather.cu, HIP through kernels/hip/vendor.h (one ABI: engram_{cuda,hip}_*)
# plus what tests/kernels/test_kernel_builds.py disassembles (PTX per arch, code object per gfx).
# VENDOR=cuda|hip|cpu|all picks what to build (the Docker images build one vendor; cpu is
# always built alongside, CPU serving and the disk tier use it).
# Flags that matter for results: no fast-math anywhere and denormals kept (-ftz=false,
# -fno-gpu-flush-denormals-to-zero): the e8m0 scale 2^-127 is an fp32 denormal.

VENDOR ?= all
KERNELS_OUT := build/kernels
# One launcher source for both GPU vendors; compat.h renames CUDA calls to HIP's.
KERNEL_GPU := kernels/cuda/engram_gather.cu
# Header dependencies come from the compiler, not hand-kept lists: every compile writes the
# headers it read to a .d beside its output (-MP: a header deleted since is no error), and the
# .d files are included below (mk/rowio.mk's rule uses the same flags).
KERNEL_DEPFLAGS = -MMD -MP -MF $(basename $@).d -MT $@

# Debian 12 defaults (scripts/setup-toolchain.sh installs them); the ROCm image points these
# at its own toolchain (docker/Dockerfile.rocm).
NVCC ?= /usr/local/cuda/bin/nvcc
HIPCXX ?= clang++-22
LLVM_SUFFIX ?= -22
ROCM_PATH ?= /usr
ROCM_BITCODE ?= /usr/lib/x86_64-linux-gnu/amdgcn/bitcode

CUDA_ARCHS := 80 89 90 100 120
CUDA_PTX_ARCH := 120
CUDA_TARGETS := $(foreach a,$(CUDA_ARCHS),sm_$(a)) compute_$(CUDA_PTX_ARCH)
HIP_ARCHS := gfx942 gfx950

CPU_LIB := $(KERNELS_OUT)/libengram_cpu.so
CUDA_LIB := $(KERNELS_OUT)/libengram_cuda.so
CUDA_PTX := $(foreach a,$(CUDA_ARCHS),$(KERNELS_OUT)/cuda/engram_gather.sm_$(a).ptx)
HIP_LIB := $(KERNELS_OUT)/libengram_hip.so
HIP_OBJ := $(KERNELS_OUT)/hip/engram_gather.o
HIP_CO := $(foreach a,$(HIP_ARCHS),$(KERNELS_OUT)/hip/engram_gather.$(a).co)
HIP_BITCODE := $(KERNELS_OUT)/hip/bitcode

# The host flags live in kernels/host-flags.mk, which the wheel carries for builds on first use.
include kernels/host-flags.mk
KERNEL_CXXFLAGS := $(ENGRAM_CPU_CXXFLAGS)
NVCC_FLAGS := -std=c++17 -O3 -ftz=false -prec-div=true -prec-sqrt=true -fmad=false \
	-Xcompiler -fPIC,-fno-fast-math,-Wall
# __AMDGCN_WAVEFRONT_SIZE: Debian's HIP 5.2 headers read it and clang 22 no longer defines it.
HIP_FLAGS := -x hip $(foreach a,$(HIP_ARCHS),--offload-arch=$(a)) --rocm-path=$(ROCM_PATH) \
	--rocm-device-lib-path=$(HIP_BITCODE) -mcode-object-version=5 \
	-D__AMDGCN_WAVEFRONT_SIZE=64 -std=c++17 -O3 -fPIC -Wall \
	-fno-gpu-flush-denormals-to-zero -ffp-contract=off

.PHONY: kernels kernels-toolchain kernels-cpu kernels-cuda kernels-hip kernels-clean
TEST_PREREQS += kernels

kernels: kernels-cpu
ifneq ($(filter cuda all,$(VENDOR)),)
kernels: kernels-cuda
endif
ifneq ($(filter hip all,$(VENDOR)),)
kernels: kernels-hip
endif
ifeq ($(filter cuda hip cpu all,$(VENDOR)),)
$(error VENDOR=$(VENDOR): expected cuda, hip, cpu or all)
endif

# Compilers come from the project's own script (quick when present). Without root it cannot
# install: then what is missing is skipped below with a message, and the tests say why.
kernels-toolchain:
	@VENDOR=$(VENDOR) HIPCXX=$(HIPCXX) NVCC=$(NVCC) bash scripts/setup-toolchain.sh || \
		echo "kernels: scripts/setup-toolchain.sh failed; builds whose compiler is missing are skipped"

kernels-cpu: kernels-toolchain
	@$(MAKE) --no-print-directory $(CPU_LIB)

kernels-cuda: kernels-toolchain
	@if command -v $(NVCC) >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory $(CUDA_LIB) $(CUDA_PTX); \
	else \
		echo "kernels: nvcc not found ($(NVCC)): skipping the CUDA build (its tests skip)"; \
	fi

kernels-hip: kernels-toolchain
	@if command -v $(HIPCXX) >/dev/null 2>&1 && [ -e $(ROCM_BITCODE)/ocml.bc ]; then \
		$(MAKE) --no-print-directory $(HIP_LIB) $(HIP_CO); \
	else \
		echo "kernels: $(HIPCXX) or ROCm device libraries missing: skipping the HIP build (its tests skip)"; \
	fi

$(CPU_LIB): kernels/cpu/engram_gather.cpp kernels/host-flags.mk mk/kernels.mk
	@mkdir -p $(@D)
	$(CXX) $(KERNEL_CXXFLAGS) $(KERNEL_DEPFLAGS) -shared -o $@ $<

# -cudart shared: libcudart is NEEDED by soname, so the library runs on the copy torch loaded
# (nvcc's default static runtime would be a second runtime in the process, with its own
# context bookkeeping; ops/native.py checks the soname against the loaded one).
$(CUDA_LIB): $(KERNEL_GPU) mk/kernels.mk
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) $(KERNEL_DEPFLAGS) -shared -cudart shared -DENGRAM_TARGETS='"$(CUDA_TARGETS)"' \
		$(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
		-gencode arch=compute_$(CUDA_PTX_ARCH),code=compute_$(CUDA_PTX_ARCH) -o $@ $<

# PTX per arch, from the same source and flags, for the disassembly checks (this toolkit has
# no cuobjdump/nvdisasm to read the SASS back).
$(KERNELS_OUT)/cuda/engram_gather.sm_%.ptx: $(KERNEL_GPU) mk/kernels.mk
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) $(KERNEL_DEPFLAGS) -ptx -arch=compute_$* -o $@ $<

# Debian's ROCm device libraries stop at gfx940: a missing gfx942/gfx950 ISA-version bitcode is
# made from the gfx940 one (only the version constant differs), next to links to the others.
# A ROCm install that has them is used as is.
$(HIP_BITCODE)/.stamp: mk/kernels.mk
	@mkdir -p $(@D)
	rm -f $(@D)/*.bc
	for f in $(ROCM_BITCODE)/*.bc; do ln -sf $$f $(@D)/; done
	for v in 942 950; do \
		[ -e $(@D)/oclc_isa_version_$$v.bc ] && continue; \
		llvm-dis$(LLVM_SUFFIX) $(ROCM_BITCODE)/oclc_isa_version_940.bc -o - \
		| sed "s/constant i32 9400/constant i32 $${v}0/" \
		| llvm-as$(LLVM_SUFFIX) -o $(@D)/oclc_isa_version_$$v.bc || exit 1; \
	done
	touch $@

$(HIP_OBJ): $(KERNEL_GPU) $(HIP_BITCODE)/.stamp mk/kernels.mk
	@mkdir -p $(@D)
	$(HIPCXX) $(HIP_FLAGS) $(KERNEL_DEPFLAGS) -DENGRAM_TARGETS='"$(HIP_ARCHS)"' -c -o $@ $<

# Left with undefined HIP symbols on purpose: they bind to the runtime torch loaded (see the
# comment at the top of kernels/cuda/engram_gather.cu).
$(HIP_LIB): $(HIP_OBJ)
	$(CXX) -shared -o $@ $<

# The code objects inside the library, unbundled for disassembly.
$(KERNELS_OUT)/hip/fatbin.bin: $(HIP_LIB)
	llvm-objcopy$(LLVM_SUFFIX) -O binary --only-section=.hip_fatbin $< $@

$(KERNELS_OUT)/hip/engram_gather.%.co: $(KERNELS_OUT)/hip/fatbin.bin
	clang-offload-bundler$(LLVM_SUFFIX) --unbundle --type=o --input=$< \
		--targets=hipv4-amdgcn-amd-amdhsa--$* --output=$@

-include $(CPU_LIB:.so=.d) $(CUDA_LIB:.so=.d) $(CUDA_PTX:.ptx=.d) $(HIP_OBJ:.o=.d)

kernels-clean:
	rm -rf $(KERNELS_OUT)/libengram_cpu.* $(KERNELS_OUT)/libengram_cuda.* \
		$(KERNELS_OUT)/libengram_hip.* $(KERNELS_OUT)/cuda $(KERNELS_OUT)/hip
