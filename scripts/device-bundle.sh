#!/bin/sh
# device-bundle.sh — packs what a GPU machine without Debian's -dev packages
# needs to run the CUDA build: build/deltafin-cuda, build/run_cuda_tests,
# build/cuda_bench (stripped) and the shared libraries deltafin-cuda links
# (glibc with its libmvec, and the C++ runtime excepted: the machine's own),
# into DIR (default .devlibs, which .git/info/exclude should list). On the GPU machine:
#   export LD_LIBRARY_PATH=$PWD/.devlibs/lib
#   DF_CUDA_BIN=.devlibs/deltafin-cuda .devlibs/run_cuda_tests
#   .devlibs/cuda_bench 2
set -eu
out=${1:-.devlibs}
make cuda >/dev/null
rm -rf "$out"
mkdir -p "$out/lib"
for f in deltafin-cuda run_cuda_tests cuda_bench; do
    cp "build/$f" "$out/$f"
    strip "$out/$f"
done
ldd build/deltafin-cuda | awk '$3 ~ /^\// {print $3}' |
    grep -vE '/(libc|libm|libmvec|libresolv|libgcc_s|libstdc\+\+|libpthread|libdl|librt)\.so' |
    while read -r lib; do cp -L "$lib" "$out/lib/"; done
du -sh "$out"
