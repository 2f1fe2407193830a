# deltafin — plain Makefile. `make help` lists the targets.
#
#   make            build build/deltafin and build/libdeltafin.a
#   make test       install missing deps, build, run every test suite
#   make demo       install missing deps, build, run a small model
#   make SAN=1 ...  the same with ASan + UBSan (objects in build-san/)
#   make fuzz       libFuzzer harnesses (clang, objects in build-fuzz/), each run
#                   FUZZ_SECONDS (default 60)
#   make CC=clang   any C17 compiler with GNU extensions (gcc, clang)
#   make test-arm64 cross-build for AArch64 (build-arm64/), run tests under qemu-user
#   make URING=0    no io_uring (the pread pool only); auto-off without liburing.h
#   make PORTABLE=1 no io_uring, no O_DIRECT (the path of macOS and other POSIX
#                   systems, objects in build-portable/); docs/PORTABLE.md

CC      ?= gcc
BUILD   ?= build
OPT     ?= -O2
WARN    := -Wall -Wextra -Wshadow -Wstrict-prototypes
CFLAGS  += -std=c17 $(OPT) -g $(WARN) $(WERROR) -D_GNU_SOURCE -Iinclude -pthread -fno-math-errno
LDLIBS  += -lmicrohttpd -lpcre2-8 -ljansson $(URING_LIB) -lcurl -lnettle -lm -lpthread

# Target machine, from the compiler (so CC=aarch64-linux-gnu-gcc cross-builds):
# x86 compiles the AVX2/AVX-512 kernel files, AArch64 the NEON ones, any other
# machine only the scalar reference.
TARGET  := $(shell $(CC) -dumpmachine 2>/dev/null)
ARCH    := $(firstword $(subst -, ,$(TARGET)))
X86_SIMD_SRC := $(wildcard src/kernels/*_avx2.c src/kernels/*_avxvnni.c src/kernels/*_avx512.c src/kernels/*_amx.c)
ARM_SIMD_SRC := $(wildcard src/kernels/*_neon.c)
ifneq (,$(filter x86_64 i386 i486 i586 i686 amd64,$(ARCH)))
SIMD_SRC := $(X86_SIMD_SRC)
# glibc's vector expf / tanhf (libmvec: part of libc6, tanhf since glibc 2.35)
# for the activations; without it (another libc, an older glibc: MVEC=0) the
# x86 levels compute them as the scalar level does
MVEC    ?= auto
ifeq ($(MVEC),auto)
MVEC    := $(shell printf '\043include <immintrin.h>\n__m256 _ZGVdN8v_tanhf(__m256);\nint main(void) { return (int)_ZGVdN8v_tanhf(_mm256_set1_ps(0.5f))[0]; }\n' | \
             $(CC) -mavx2 -x c - -o /dev/null -lmvec -lm >/dev/null 2>&1 && echo 1 || echo 0)
endif
ifeq ($(MVEC),1)
LDLIBS   += -lmvec
else
CFLAGS   += -DDF_NO_MVEC
endif
else ifneq (,$(filter aarch64 arm64,$(ARCH)))
SIMD_SRC := $(ARM_SIMD_SRC)
# AArch64 always has FMA: keep clang from contracting the scalar reference
# (gcc does not in -std=c17), so both compilers compute the same oracle.
CFLAGS   += -ffp-contract=off
else
SIMD_SRC :=
endif

# io_uring (liburing): on where the compiler finds <liburing.h> (Linux with
# liburing-dev), else the pread pool; URING=0 forces it off. PORTABLE=1 also
# leaves O_DIRECT unused (nocache fds + page-cache drops instead), as on macOS.
ifeq ($(PORTABLE),1)
URING   := 0
BUILD   := build-portable
CFLAGS  += -DDF_NO_ODIRECT
endif
URING   ?= auto
ifeq ($(URING),auto)
URING   := $(shell printf '\043include <liburing.h>\n' | $(CC) -E -x c - >/dev/null 2>&1 && echo 1 || echo 0)
endif
ifeq ($(URING),1)
URING_LIB := -luring
else
URING_LIB :=
CFLAGS  += -DDF_NO_URING
endif

ifeq ($(SAN),1)
BUILD   := build-san
OPT     := -O1
CFLAGS  += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
LDFLAGS += -fsanitize=address,undefined
endif

# `make fuzz` builds with FUZZ=1 CC=clang BUILD=build-fuzz: every object gets
# libFuzzer's coverage hooks and ASan + UBSan; harnesses link -fsanitize=fuzzer.
ifeq ($(FUZZ),1)
OPT     := -O1
CFLAGS  += -fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
endif
FUZZ_SECONDS ?= 60
FUZZ_CC      ?= clang

# SIMD variants get their ISA flags per file; everything else stays portable.
AVX2_FLAGS   := -mavx2 -mfma -mf16c
AVX512_FLAGS := -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512vbmi -mavx512bf16 -mfma -mf16c -mavx2
AMX_FLAGS    := -mamx-tile -mamx-bf16

LIB_SRC  := $(filter-out $(filter-out $(SIMD_SRC),$(X86_SIMD_SRC) $(ARM_SIMD_SRC)), \
            $(sort $(wildcard src/base/*.c src/format/*.c src/kernels/*.c src/model/*.c src/synth/*.c src/experts/*.c src/text/*.c src/hub/*.c src/server/*.c src/spine8/*.c)))
CLI_SRC  := $(sort $(wildcard src/cli/*.c))
TEST_SRC := $(sort $(wildcard tests/*.c))
FUZZ_SRC := $(sort $(wildcard tests/fuzz/fuzz_*.c))
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o)
CLI_OBJ  := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)
FUZZ_OBJ := $(FUZZ_SRC:%.c=$(BUILD)/%.o) $(BUILD)/tests/fuzz/common.o
FUZZ_BIN := $(FUZZ_SRC:tests/fuzz/fuzz_%.c=$(BUILD)/fuzz/%)

.PHONY: all test demo deps help clean bench cuda test-cuda check-warnings fuzz fuzz-bins fuzz-objs \
        test-arm64 deps-arm64 test-portable cuda-objs
all: $(BUILD)/deltafin $(BUILD)/libdeltafin.a

help:
	@echo "targets:"
	@echo "  all (default)   build/deltafin and build/libdeltafin.a"
	@echo "  test            install deps if missing, build, run all tests (N passed, N failed)"
	@echo "  demo            install deps if missing, build, run a small model, print tokens/s"
	@echo "  bench           kernel benchmark (deltafin bench --kernels)"
	@echo "  deps            install the Debian packages the build needs"
	@echo "  check-warnings  build with gcc and clang, -Werror"
	@echo "  fuzz            libFuzzer harnesses for every parser of outside bytes (clang, ASan+UBSan,"
	@echo "                  build-fuzz/), each run FUZZ_SECONDS=60 (FUZZ_ONLY=\"a b\" picks); tests/fuzz/README.md"
	@echo "  cuda            CUDA backend (nvcc, sm_90 + PTX): build/libdeltafin_cuda.a,"
	@echo "                  build/run_cuda_tests, build/cuda_bench; needs no GPU to build"
	@echo "  test-cuda       make cuda, then run the CUDA tests (they skip without a GPU)"
	@echo "  cuda-objs       compile the CUDA backend without linking; with CC=aarch64-linux-gnu-gcc"
	@echo "                  BUILD=build-arm64 it cross-compiles it for AArch64 (Grace); docs/PORTABLE.md"
	@echo "  test-arm64      cross-compile for AArch64 (gcc-aarch64-linux-gnu, build-arm64/) and run"
	@echo "                  ARM64_TESTS under qemu-user (default: all but four slow, architecture-"
	@echo "                  neutral suites: trained_eval, s8_eval, server_2_trained, server_3 (node);"
	@echo "                  ARM64_TESTS= runs all); installs the cross packages if missing"
	@echo "                  (scripts/install-deps-arm64.sh); 4-5 min here with its build"
	@echo "  test-portable   PORTABLE=1 build (no io_uring, no O_DIRECT: the pread pool with"
	@echo "                  nocache fds, as on macOS), runs PORTABLE_TESTS (the I/O suites)"
	@echo "  clean           remove build outputs"
	@echo "options: SAN=1 (ASan+UBSan in build-san/), CC=clang, OPT=-O3, MVEC=0 (no libmvec: scalar expf/tanhf"
	@echo "         in the activations), URING=0 (no io_uring; give it"
	@echo "         its own BUILD=dir), PORTABLE=1 (no io_uring, no O_DIRECT; build-portable/),"
	@echo "         CC=aarch64-linux-gnu-gcc BUILD=build-arm64 (cross-build; the NEON kernels)"

deps:
	@sh scripts/install-deps.sh

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/src/kernels/%_avx2.o: src/kernels/%_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(AVX2_FLAGS) -MMD -MP -c $< -o $@

$(BUILD)/src/kernels/%_avxvnni.o: src/kernels/%_avxvnni.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(AVX2_FLAGS) -mavxvnni -MMD -MP -c $< -o $@

$(BUILD)/src/kernels/%_avx512.o: src/kernels/%_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(AVX512_FLAGS) -MMD -MP -c $< -o $@

$(BUILD)/src/kernels/%_amx.o: src/kernels/%_amx.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(AVX512_FLAGS) $(AMX_FLAGS) -MMD -MP -c $< -o $@

# NEON (AArch64 Advanced SIMD) is part of the base ISA: no flags needed.
$(BUILD)/src/kernels/%_neon.o: src/kernels/%_neon.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(NEON_FLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libdeltafin.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/deltafin: $(CLI_OBJ) $(BUILD)/libdeltafin.a
	$(CC) $(LDFLAGS) -pthread -o $@ $(CLI_OBJ) $(BUILD)/libdeltafin.a $(LDLIBS)

$(BUILD)/run_tests: $(TEST_OBJ) $(BUILD)/libdeltafin.a
	$(CC) $(LDFLAGS) -pthread -o $@ $(TEST_OBJ) $(BUILD)/libdeltafin.a $(LDLIBS)

# the server tests' openai client (tests/server/package-lock.json), once;
# without the npm registry those two tests skip and say why
SERVER_NPM := tests/server/node_modules/openai/package.json

test:
	@sh scripts/install-deps.sh
	@[ -f $(SERVER_NPM) ] || npm ci --prefix tests/server --no-audit --no-fund --silent || \
	    echo "make test: npm ci --prefix tests/server failed; the openai client tests will skip"
	@$(MAKE) --no-print-directory $(BUILD)/deltafin $(BUILD)/run_tests
	@DF_BIN=$(BUILD)/deltafin ./$(BUILD)/run_tests

demo:
	@sh scripts/install-deps.sh
	@$(MAKE) --no-print-directory $(BUILD)/deltafin
	@sh scripts/demo.sh $(BUILD)/deltafin

# The harnesses: one per parser (tests/fuzz/fuzz_NAME.c -> $(BUILD)/fuzz/NAME);
# cli_args also links the CLI's objects but main.o.
$(BUILD)/fuzz/%: $(BUILD)/tests/fuzz/fuzz_%.o $(BUILD)/tests/fuzz/common.o $(BUILD)/libdeltafin.a
	@mkdir -p $(dir $@)
	$(CC) -fsanitize=fuzzer,address,undefined -pthread -o $@ $(filter %.o,$^) $(BUILD)/libdeltafin.a $(LDLIBS)
$(BUILD)/fuzz/cli_args: $(filter-out $(BUILD)/src/cli/main.o,$(CLI_OBJ))

fuzz-bins: $(FUZZ_BIN)
fuzz-objs: $(FUZZ_OBJ)

fuzz:
	@sh scripts/install-deps.sh
	@$(MAKE) --no-print-directory FUZZ=1 SAN= CC=$(FUZZ_CC) BUILD=build-fuzz fuzz-bins
	@sh tests/fuzz/run.sh build-fuzz $(FUZZ_SECONDS) $(FUZZ_ONLY)

bench: $(BUILD)/deltafin
	./$(BUILD)/deltafin bench --kernels

check-warnings:
	$(MAKE) BUILD=build-gcc CC=gcc WERROR=-Werror all build-gcc/run_tests fuzz-objs
	$(MAKE) BUILD=build-clang CC=clang WERROR=-Werror all build-clang/run_tests fuzz-objs

# ---- AArch64 under emulation: Debian's cross gcc, the arm64 libraries
# (multiarch), qemu-user. DF_BIN points the CLI/server tests at a wrapper that
# runs the aarch64 binary through qemu (no binfmt_misc needed).
ARM64_CC    ?= aarch64-linux-gnu-gcc
ARM64_QEMU  ?= qemu-aarch64
# The default subset leaves out, for CI's time (each is 40-110 s under qemu and
# checks nothing architecture-specific that the rest does not): the trained
# model's perplexity eval and the int8 spine's eval (trained_logits and
# s8_int8_logits stay), the server's trained-model answer and the node
# openai-client suite (protocol only; its load check's RSS bound measures
# qemu's own memory under emulation). ARM64_TESTS= (empty) runs everything.
ARM64_TESTS ?= -trained_eval -s8_eval -server_2_trained -server_3
ARM64_BUILD := build-arm64

deps-arm64:
	@sh scripts/install-deps-arm64.sh

test-arm64: deps-arm64
	@$(MAKE) --no-print-directory CC=$(ARM64_CC) BUILD=$(ARM64_BUILD) $(ARM64_BUILD)/deltafin $(ARM64_BUILD)/run_tests
	@printf '#!/bin/sh\nexec $(ARM64_QEMU) "$$(dirname "$$0")/deltafin" "$$@"\n' > $(ARM64_BUILD)/deltafin-qemu
	@chmod +x $(ARM64_BUILD)/deltafin-qemu
	@DF_BIN=$(ARM64_BUILD)/deltafin-qemu $(ARM64_QEMU) ./$(ARM64_BUILD)/run_tests $(ARM64_TESTS)

# The portable I/O path on this machine: io_uring and O_DIRECT compiled out.
PORTABLE_TESTS ?= xr_ xs_ model_threads_and_io model_expert_io hub_stream_logits_identical
test-portable:
	@$(MAKE) --no-print-directory PORTABLE=1 build-portable/deltafin build-portable/run_tests
	@DF_BIN=build-portable/deltafin ./build-portable/run_tests $(PORTABLE_TESTS)

# ---- CUDA backend: src/cuda/*.cu. The CPU build never needs CUDA; the tests
# link the CPU scalar kernels (their oracle) from the objects below.
NVCC      ?= $(or $(shell command -v nvcc 2>/dev/null),/usr/local/cuda/bin/nvcc)
CUDA_ARCH := -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
GPU_DEFS  ?=
# An AArch64 build (Grace: GH200, GB200, DGX Spark) on an AArch64 host needs
# nothing special: nvcc from the sbsa (arm64-sbsa) toolkit, `make cuda`, with
# CUDA_ARCH set for the GPU (docs/PORTABLE.md). Cross-compiling from x86
# (CC=aarch64-linux-gnu-gcc) gives nvcc the cross g++ as host compiler; with
# no sbsa-linux target directory in the toolkit, the x86_64-linux headers
# (the same files) stand in, so `cuda-objs` (the objects and
# libdeltafin_cuda.a) compiles, but the executables need the sbsa toolkit's
# aarch64 libcudart to link.
HOST_ARCH := $(shell uname -m)
CUDA_HOME := $(patsubst %/bin/nvcc,%,$(NVCC))
ifneq (,$(filter aarch64 arm64,$(ARCH)))
ifeq (,$(filter aarch64 arm64,$(HOST_ARCH)))
CUDA_TARGET_DIR ?= $(if $(wildcard $(CUDA_HOME)/targets/sbsa-linux),sbsa-linux,x86_64-linux)
NVCC_HOST := -ccbin $(patsubst %gcc,%g++,$(CC)) -target-dir $(CUDA_TARGET_DIR)
endif
endif
NVFLAGS   := -O3 -std=c++17 $(CUDA_ARCH) $(NVCC_HOST) -Iinclude -lineinfo -Xcompiler -Wall,-Wextra,-Wno-unused-parameter $(GPU_DEFS)
comma := ,
CUDA_SRC  := $(sort $(wildcard src/cuda/*.cu))
CUDA_OBJ  := $(CUDA_SRC:%.cu=$(BUILD)/%.o)
CUDA_ORACLE := $(addprefix $(BUILD)/src/,base/err.o format/dtype.o kernels/matvec.o kernels/matvec_driver.o \
               kernels/ops.o model/kda_core.o model/mla_core.o) \
               $(patsubst %.c,$(BUILD)/%.o,$(SIMD_SRC))

CUDA_CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/cuda-cli/%.o)

cuda: $(BUILD)/libdeltafin_cuda.a $(BUILD)/run_cuda_tests $(BUILD)/cuda_bench $(BUILD)/deltafin-cuda $(BUILD)/wg_shape_probe
# compile only (no link): e.g. make CC=aarch64-linux-gnu-gcc BUILD=build-arm64 cuda-objs
cuda-objs: $(BUILD)/libdeltafin_cuda.a $(CUDA_CLI_OBJ) $(BUILD)/libdeltafin.a

# The CLI again with -DDF_WITH_CUDA (--device auto|cpu|cuda, --gpu-mem), linked
# with the CUDA backend by nvcc, which finds its own (static) cudart wherever the
# toolkit lives, symlinked nvcc included; build/deltafin itself never needs CUDA.
$(BUILD)/cuda-cli/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DDF_WITH_CUDA -MMD -MP -c $< -o $@

$(BUILD)/deltafin-cuda: $(CUDA_CLI_OBJ) $(BUILD)/libdeltafin.a $(BUILD)/libdeltafin_cuda.a
	$(NVCC) $(CUDA_ARCH) $(NVCC_HOST) -o $@ $(CUDA_CLI_OBJ) $(BUILD)/libdeltafin.a $(BUILD)/libdeltafin_cuda.a $(LDLIBS)

# the CUDA objects see deltafin.h's structs (df_accel, its stats) and the
# format / model headers gpu.h includes: any change there rebuilds them
CUDA_HDRS := $(wildcard src/cuda/*.h) include/deltafin.h $(wildcard src/format/*.h src/model/*.h src/base/*.h)
$(BUILD)/src/cuda/%.o: src/cuda/%.cu $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

# wgmma exists only in the architecture-specific sm_90a target: where the
# build targets compute 9.0 (the default), the wgmma files (gpu_bf16_wg.cu,
# gpu_mx_wg.cu) are compiled for sm_90a alone (their host side then says so:
# DF_WG_SM90A); elsewhere their kernels are empty and gpu_ws_wg_present()
# is 0.
WG_ARCH := $(if $(findstring compute_90,$(CUDA_ARCH)),-gencode arch=compute_90a$(comma)code=sm_90a -DDF_WG_SM90A,$(CUDA_ARCH))
$(BUILD)/src/cuda/gpu_bf16_wg.o $(BUILD)/src/cuda/gpu_mx_wg.o: $(BUILD)/src/cuda/%.o: src/cuda/%.cu $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(NVCC) $(filter-out $(CUDA_ARCH),$(NVFLAGS)) $(WG_ARCH) -c $< -o $@

$(BUILD)/libdeltafin_cuda.a: $(CUDA_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/run_cuda_tests: $(BUILD)/tests/test_main.o $(BUILD)/tests/cuda/test_cuda.o $(BUILD)/tests/cuda/test_cuda_engine.o \
                         $(BUILD)/tests/cuda/test_cuda_attn.o $(BUILD)/libdeltafin_cuda.a $(CUDA_ORACLE)
	$(NVCC) $(CUDA_ARCH) $(NVCC_HOST) -o $@ $^ -lpthread -lm

$(BUILD)/cuda_bench: bench/cuda_bench.cu $(BUILD)/libdeltafin_cuda.a $(wildcard src/cuda/*.h)
	$(NVCC) $(NVFLAGS) -o $@ $< $(BUILD)/libdeltafin_cuda.a

# the wgmma issue patterns' ceilings (a measurement tool; sm_90a like the wgmma files)
$(BUILD)/wg_shape_probe: bench/wg_shape_probe.cu $(wildcard src/cuda/*.h)
	$(NVCC) $(filter-out $(CUDA_ARCH),$(NVFLAGS)) $(WG_ARCH) -Isrc/cuda -o $@ $<

test-cuda: cuda
	DF_CUDA_BIN=$(BUILD)/deltafin-cuda ./$(BUILD)/run_cuda_tests

clean:
	rm -rf build build-san build-gcc build-clang build-fuzz build-arm64 build-arm64-clang build-portable

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(FUZZ_OBJ:.o=.d) $(BUILD)/tests/cuda/test_cuda.d \
	$(BUILD)/tests/cuda/test_cuda_engine.d $(BUILD)/tests/cuda/test_cuda_attn.d $(CUDA_CLI_OBJ:.o=.d)
