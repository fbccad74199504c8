/* Which SIMD path the runtime helpers use, and how many OpenMP threads they may take.
 * Decided once from the CPU (GCC's __builtin_cpu_supports also checks that the OS saves the wide
 * registers); BITNET_ISA=scalar|avx2|avx512 forces a path, like simd._kernels. */
#include "ops.h"

#include <stdlib.h>
#include <string.h>
#include <omp.h>

static int g_isa = -2;     /* -2: not decided yet */
static int g_threads = 0;  /* 0: not set -> all processors */

int ops_cpu_max_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return OPS_ISA_AVX512;
    if (avx2) return OPS_ISA_AVX2;
#endif
    return OPS_ISA_SCALAR;
}

int ops_set_isa(int isa) {
    int best = ops_cpu_max_isa();
    if (isa < 0) {
        g_isa = best;
        return 0;
    }
    if (isa > best) return -1;
    g_isa = isa;
    return 0;
}

int ops_isa(void) {
    if (g_isa == -2) {
        const char *env = getenv("BITNET_ISA");
        int want = -1;
        if (env && !strcmp(env, "scalar")) want = OPS_ISA_SCALAR;
        else if (env && !strcmp(env, "avx2")) want = OPS_ISA_AVX2;
        else if (env && !strcmp(env, "avx512")) want = OPS_ISA_AVX512;
        if (ops_set_isa(want) != 0) ops_set_isa(-1); /* simd._kernels already raised for a bad override */
    }
    return g_isa;
}

void ops_set_num_threads(int n) { g_threads = n > 0 ? n : omp_get_num_procs(); }

int ops_get_num_threads(void) {
    if (g_threads <= 0) g_threads = omp_get_num_procs();
    return g_threads;
}

int ops_thread_num(void) { return omp_get_thread_num(); }
