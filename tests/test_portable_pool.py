"""The worker pool's non-Linux wait (a condition variable where futex does not exist: macOS, the BSDs), run here
on Linux by building simd/kernels/threadpool.c with __linux__ undefined, the caller's spin cut to nothing so
every job that a worker still holds ends in that wait. Many jobs over one shared range must each cover every
index exactly once, and the caller must have slept (the path under test ran). No macOS machine was at hand:
this is the closest check of that build that runs.
"""
import os
import shutil
import subprocess

import pytest

from cross_c import CC_HOST as CC, KERNELS, host_objects_except

HARNESS = r"""
#include <stdio.h>
#include <stdatomic.h>
#include "kernels.h"

static _Atomic int hits[4096];
static void work(void *ctx, int b, int e) {
    (void)ctx;
    volatile double s = 0; /* enough work per chunk that workers hold some chunks when the caller is done */
    for (int i = b; i < e; i++) { atomic_fetch_add(&hits[i], 1); for (int j = 0; j < 200; j++) s += j; }
}

int main(void) {
    int bad = 0;
    for (int job = 0; job < 2000; job++) {
        int n = 1 + (job * 97) % 4096;
        for (int i = 0; i < n; i++) atomic_store(&hits[i], 0);
        bk_parallel_for(n, 1 + job % 7, 2 + job % 3, work, NULL);
        for (int i = 0; i < n; i++) bad += atomic_load(&hits[i]) != 1;
    }
    uint64_t jobs, chunks, sleeps;
    bk_pool_stats(&jobs, &chunks, &sleeps);
    printf("jobs %llu worker_chunks %llu caller_sleeps %llu bad %d\n", (unsigned long long)jobs,
           (unsigned long long)chunks, (unsigned long long)sleeps, bad);
    return bad != 0 || sleeps == 0;
}
"""


@pytest.mark.skipif(CC is None, reason="no C compiler (gcc or cc) on PATH")
def test_condition_variable_wait_covers_every_chunk(tmp_path):
    src = tmp_path / "pool_harness.c"
    src.write_text(HARNESS)
    exe = tmp_path / "pool_harness"
    # only the pool is built with the non-Linux flags; the other kernels come from the harnesses' object cache
    r = subprocess.run([CC, "-O1", "-std=c11", "-pthread", "-Wall", "-U__linux__", "-DWAIT_SPIN_NS=0", "-DSPIN_NS=0",
                        "-I", KERNELS, str(src), os.path.join(KERNELS, "threadpool.c"),
                        *host_objects_except("threadpool.c"), "-o", str(exe), "-lm"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # the build really took the non-Linux branch: no futex syscall in it
    nm = shutil.which("nm")
    if nm:
        syms = subprocess.run([nm, str(exe)], capture_output=True, text=True).stdout
        assert "pthread_cond_broadcast" in syms
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
