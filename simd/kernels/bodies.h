/* The one place for what every kernel file would otherwise write again around its bodies: the per-ISA body
 * table, the choice of a body for the active path, and the threaded driver's job (the body pointer and its
 * arguments) with the range function the worker pool calls.
 *
 * Body table: one entry per ISA that has a body of its own, in one initializer with no #if; an entry of the
 * other architecture expands to nothing, a missing entry stays NULL:
 *     const bk_gemv_i8_fn bk_gemv_i8_bodies[BK_N_ISA] = {
 *         BK_BODY(SCALAR, gemv_i8_scalar) BK_X86_BODY(AVX2, gemv_i8_avx2) BK_X86_BODY(AVX512, gemv_i8_avx512)
 *         BK_ARM_BODY(DOTPROD, gemv_i8_neon)
 *     };
 * BK_PICK(table, isa) is the body of isa, else that of the first path down that has one (bk_isa_down: avxvnni
 * and avx512 -> avx2, i8mm -> dotprod -> neon), else the scalar reference: never NULL, so a kernel is never missing.
 * Adding an ISA body: write the function under its architecture's #if (e.g. `#if defined(__aarch64__)`), add
 * its entry to the table (e.g. BK_ARM_BODY(NEON, gemv_i8_neon_plain)), and the kernel tests compare it with the
 * scalar reference (BITNET_ISA / set_isa select it). Nothing else changes: drivers take the body from
 * bk_table (dispatch.c) or BK_PICK.
 *
 * Threaded driver: one list of the body's arguments, ARGS(X) calling X(type, name) once per argument in the
 * body's order (the body then takes tile_begin, tile_end), gives
 *   BK_JOB_STRUCT(job, fn_type, ARGS)   typedef struct { fn_type fn; <one field per argument> } job
 *   BK_TILE_JOB(job, fn_type, ARGS)     that struct, plus job_range: the bk_range_fn calling fn on tiles [b, e)
 *   BK_JOB_INIT(fn, ARGS)               the struct's initializer from the caller's variables of those names
 *   BK_RUN_TILE_JOB(job, fn, ARGS, n, work_per_tile, min_work)
 *                                       the driver's body: fn over the (n + 15) / 16 tiles of n rows on the
 *                                       pool, or on the caller alone when the work is under min_work
 */
#ifndef BITNET_BODIES_H
#define BITNET_BODIES_H

#define BK_BODY(isa, fn) [BK_ISA_##isa] = (fn),
#if defined(__x86_64__)
#define BK_X86_BODY(isa, fn) BK_BODY(isa, fn)
#else
#define BK_X86_BODY(isa, fn)
#endif
#if defined(__aarch64__)
#define BK_ARM_BODY(isa, fn) BK_BODY(isa, fn)
#else
#define BK_ARM_BODY(isa, fn)
#endif

/* dispatch.c: the path a missing body falls back to first (then scalar) */
int bk_isa_down(int isa);
/* the ladder is at most three paths deep (i8mm -> dotprod -> neon), then scalar */
#define BK_DOWN2(isa) bk_isa_down(bk_isa_down(isa))
#define BK_PICK(bodies, isa)                                                                                 \
    ((bodies)[isa]                  ? (bodies)[isa]                                                          \
     : (bodies)[bk_isa_down(isa)]   ? (bodies)[bk_isa_down(isa)]                                             \
     : (bodies)[BK_DOWN2(isa)]      ? (bodies)[BK_DOWN2(isa)]                                                \
                                    : (bodies)[BK_ISA_SCALAR])

#define BK_JOB_FIELD(type, name) type name;
#define BK_JOB_ARG(type, name) j->name,
#define BK_JOB_VALUE(type, name) name,
#define BK_JOB_STRUCT(job, fn_type, ARGS) \
    typedef struct {                      \
        fn_type fn;                       \
        ARGS(BK_JOB_FIELD)                \
    } job
#define BK_TILE_JOB(job, fn_type, ARGS)                   \
    BK_JOB_STRUCT(job, fn_type, ARGS);                    \
    static void job##_range(void *ctx, int b, int e) {    \
        job *j = ctx;                                     \
        j->fn(ARGS(BK_JOB_ARG) b, e);                     \
    }
#define BK_JOB_INIT(fn, ARGS) {(fn), ARGS(BK_JOB_VALUE)}
#define BK_RUN_TILE_JOB(job, fn, ARGS, n, work_per_tile, min_work)                                   \
    do {                                                                                           \
        job job_ = BK_JOB_INIT(fn, ARGS);                                                          \
        const int n_tiles_ = ((n) + 15) / 16;                                                      \
        bk_run_tiles(n_tiles_, (size_t)n_tiles_ * (work_per_tile), (min_work), job##_range, &job_); \
    } while (0)

#endif
