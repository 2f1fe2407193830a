#!/bin/sh
# cuda_variant.sh — a measurement build: build/deltafin-cuda,
# build/cuda_bench and build/run_cuda_tests again with CUDA files
# recompiled with -D flags (the kernels' build knobs: GPU_FRAG_XS,
# GPU_XS_BLOCKS, GPU_TCB_VG, GPU_MLA_TC, ...), written beside them as
# OUT_PREFIX-deltafin-cuda, OUT_PREFIX-cuda_bench and
# OUT_PREFIX-run_cuda_tests, so a device call can run a variant against the
# default build side by side, and its device tests (`OUT_PREFIX-run_cuda_tests
# cuda_attn`). Needs `make cuda` first (it links against its objects);
# builds no GPU code for anything but sm_90 (sm_90a for the wgmma files, as
# the Makefile does). LIBS overrides the link's libraries (the Makefile's
# LDLIBS of an x86-64 build by default), LIBS_TESTS the tests' extra ones.
#
#   bench/cuda_variant.sh OUT_PREFIX src/cuda/gpu_mma.cu -DGPU_XS_BLOCKS=4
#   bench/cuda_variant.sh p4 src/cuda/gpu_mma.cu src/cuda/gpu_mx_wg.cu -DGPU_FRAG_WG=0 -DGPU_MW_P=4
set -eu
[ $# -ge 2 ] || { echo "usage: $0 OUT_PREFIX FILE.cu [FILE.cu ...] [-DNAME=VALUE ...]" >&2; exit 2; }
out=$1; shift
srcs=
while [ $# -gt 0 ]; do case "$1" in *.cu) srcs="$srcs $1"; shift ;; *) break ;; esac; done
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
A="-gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90"
[ -f build/libdeltafin_cuda.a ] && [ -f build/libdeltafin.a ] || { echo "$0: run make cuda first" >&2; exit 1; }
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
cp build/libdeltafin_cuda.a "$d/lib.a"
for src in $srcs; do
    b=$(basename "$src" .cu)
    FA=$A
    case "$b" in gpu_bf16_wg | gpu_mx_wg) FA="-gencode arch=compute_90a,code=sm_90a -DDF_WG_SM90A" ;; esac # the Makefile's WG_ARCH
    "$NVCC" -O3 -std=c++17 $FA -Iinclude -lineinfo "$@" -c "$src" -o "$d/$b.o"
    ar r "$d/lib.a" "$d/$b.o" 2>/dev/null
done
"$NVCC" $A -o "$out-deltafin-cuda" build/cuda-cli/src/cli/*.o build/libdeltafin.a "$d/lib.a" \
    ${LIBS:--lmicrohttpd -lpcre2-8 -ljansson -luring -lcurl -lnettle -lm -lpthread -lmvec}
"$NVCC" -O3 -std=c++17 $A -Iinclude -o "$out-cuda_bench" bench/cuda_bench.cu "$d/lib.a"
# the device tests against the variant (their CPU oracles from libdeltafin.a)
"$NVCC" $A -o "$out-run_cuda_tests" build/tests/test_main.o build/tests/cuda/test_cuda*.o "$d/lib.a" \
    build/libdeltafin.a -lpthread -lm ${LIBS_TESTS:--lmvec}
echo "$out-deltafin-cuda $out-cuda_bench $out-run_cuda_tests"
