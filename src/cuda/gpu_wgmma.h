/* gpu_wgmma.h — the PTX of Hopper's warpgroup tensor-core instructions that
 * the wgmma kernels share (gpu_bf16_wg.cu, gpu_mx_wg.cu, and the measurement
 * tool bench/wg_shape_probe.cu): descriptors, fences, groups, the register
 * hold that keeps the compiler from moving accumulator reads or writes
 * across an asynchronous wgmma, and the bf16 forms (wg_mma, wg_mma_ss256).
 * Refuses: nothing; WG_DEVICE is 1 only in a pass compiled for sm_90a (the
 * Makefile builds these files for sm_90a alone), and the helpers exist only
 * there.
 */
#ifndef DF_GPU_WGMMA_H
#define DF_GPU_WGMMA_H

#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_DEVICE 1 /* this pass compiles for sm_90a: wgmma exists */
#else
#define WG_DEVICE 0
#endif

#if WG_DEVICE
namespace {
/* wgmma's shared-memory matrix descriptor: no swizzle, K-major; lbo the byte
 * step between core matrices along k, sbo along the vectors. */
__device__ __forceinline__ uint64_t wg_desc(const void *smem, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a & 0x3ffff) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/* the "+f" operands of accumulators d[i .. i + 7], for the forms' asm */
#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
/* bf16 d += A B: A 64 x 16 (this warp's 16 rows in a0..a3, mma.sync's
 * fragment layout), B 16 x 64 (d[32]) or 16 x 128 (d[64]) vectors from
 * shared memory (descriptor b); k_bt_wg's products. */
__device__ __forceinline__ void wg_mma(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
                 "{%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(1));
}
__device__ __forceinline__ void wg_mma(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
                 "{%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
                 : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(1));
}
/* d += A B for the tensor-core probe: A 64 x 16 and B 16 x 256 both from
 * shared memory (descriptors a, b), m64n256k16: wgmma's widest form. */
__device__ __forceinline__ void wg_mma_ss256(float (&d)[128], uint64_t a, uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
                 "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
                 "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
                 "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
                 "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
                 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56),
                   WG_D8(64), WG_D8(72), WG_D8(80), WG_D8(88), WG_D8(96), WG_D8(104), WG_D8(112), WG_D8(120)
                 : "l"(a), "l"(b), "r"(1));
}
/* keeps the compiler from moving accumulator reads or writes across a wgmma */
template <int R> __device__ __forceinline__ void wg_hold(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

} // namespace
#endif

#endif
