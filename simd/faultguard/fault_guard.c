/* fault_guard.c: turn a SIGBUS on a memory-mapped file into one line on stderr and a clean exit.
 *
 * Reading a mapped file that another process truncated (a download still being written, `cp` over the
 * file, a full disk) raises SIGBUS at the faulting load. A Python-level handler cannot help: it would run
 * only after the C load returns, and the load re-executes and faults again. So this handler lives in C
 * and does only async-signal-safe things (write, unlink, _exit, sigaction):
 *   - the faulting address lies in a registered region: write that region's message (prepared at
 *     registration, e.g. "x.bnstore: the file changed or was truncated while in use") plus the note,
 *     unlink every registered cleanup path (temporary files), _exit(exit_code);
 *   - anywhere else (a bug): write a "please report" line, unlink the cleanup paths, restore the previous
 *     action and return, so the load faults again and the process dies as before (core dump, faulthandler).
 * Tables are fixed-size static arrays; a slot is published by setting `used` last (release) and read with
 * acquire, so the handler never sees a half-written entry. Nothing here knows about models.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "fault_guard.h"

typedef struct {
    int used;
    uintptr_t start, end;
    char message[FG_MESSAGE_MAX];
} fg_region;

typedef struct {
    int used;
    char path[FG_PATH_MAX];
} fg_cleanup;

static fg_region regions[FG_MAX_REGIONS];
static fg_cleanup cleanups[FG_MAX_CLEANUPS];
static char prefix[FG_MESSAGE_MAX];
static char note[FG_MESSAGE_MAX];
static int exit_code = 2;
static int installed = 0;
static int fired = 0;
/* Linux raises SIGBUS for a load from a page past a truncated file's end. macOS (Darwin) documents SIGBUS
 * too, but has raised SIGSEGV for the same fault on some versions, so there the guard takes both, and a
 * SIGSEGV outside the registered regions goes back to its previous action exactly like a stray SIGBUS.
 * Compiled for Darwin by nobody here: no macOS machine was available (docs/arm.md). */
#if defined(__APPLE__)
static const int guarded[] = {SIGBUS, SIGSEGV};
#else
static const int guarded[] = {SIGBUS};
#endif
#define N_GUARDED ((int)(sizeof guarded / sizeof guarded[0]))
static struct sigaction previous[N_GUARDED];

static size_t bounded_copy(char *dst, const char *src, size_t cap) {
    size_t n = 0;
    if (!src) src = "";
    while (n + 1 < cap && src[n]) {
        char c = src[n];
        dst[n] = (c == '\n' || c == '\r') ? ' ' : c;  /* one line, whatever the caller passed */
        n++;
    }
    dst[n] = 0;
    return n;
}

static void put(const char *s) {
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(2, s, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return;
        }
        s += w;
        n -= (size_t)w;
    }
}

static void put_hex(uintptr_t v) {
    char buf[2 + 2 * sizeof(uintptr_t) + 1];
    int i = (int)sizeof(buf) - 1;
    buf[i] = 0;
    do {
        buf[--i] = "0123456789abcdef"[v & 15];
        v >>= 4;
    } while (v && i > 2);
    buf[--i] = 'x';
    buf[--i] = '0';
    put(buf + i);
}

static void unlink_all(void) {
    for (int i = 0; i < FG_MAX_CLEANUPS; i++)
        if (__atomic_load_n(&cleanups[i].used, __ATOMIC_ACQUIRE) == 1) unlink(cleanups[i].path);
}

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    if (__atomic_exchange_n(&fired, 1, __ATOMIC_ACQ_REL)) {
        for (;;) pause();  /* another thread is already reporting and exiting */
    }
    uintptr_t addr = (uintptr_t)info->si_addr;
    const char *msg = NULL;
    for (int i = 0; i < FG_MAX_REGIONS; i++) {
        if (__atomic_load_n(&regions[i].used, __ATOMIC_ACQUIRE) == 1 && addr >= regions[i].start && addr < regions[i].end) {
            msg = regions[i].message;
            break;
        }
    }
    unlink_all();
    put(prefix);
    if (msg) {
        put(msg);
        put(note);
        put("\n");
        _exit(exit_code);
    }
    put(sig == SIGBUS ? "bus error at " : "invalid memory access at ");
    put_hex(addr);
    put(" outside any model file: this is a bug, please report it");
    put(note);
    put("\n");
    for (int i = 0; i < N_GUARDED; i++)  /* return: the load faults again, now with the old action */
        if (guarded[i] == sig) sigaction(sig, &previous[i], NULL);
}

int fault_guard_install(const char *message_prefix, int code) {
    bounded_copy(prefix, message_prefix, sizeof prefix);
    exit_code = code;
    if (installed) return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < N_GUARDED; i++)
        if (sigaction(guarded[i], &sa, &previous[i]) != 0) return -1;
    installed = 1;
    return 0;
}

int fault_guard_installed(void) { return installed; }

/* Claim the first free slot of a table (used: 0 -> -1, taken but not yet visible to the handler, which reads
 * only slots at 1): its index, or -1 when all are taken. The caller fills the slot, then publishes it. */
#define CLAIM_SLOT(table, count) claim_slot(&(table)[0].used, sizeof(table)[0], (count))
static int claim_slot(int *first_used, size_t stride, int count) {
    for (int i = 0; i < count; i++) {
        int expected = 0;
        int *used = (int *)((char *)first_used + (size_t)i * stride);
        if (__atomic_compare_exchange_n(used, &expected, -1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return i;
    }
    return -1;
}

int fault_guard_add_region(const void *start, size_t length, const char *message) {
    int i = CLAIM_SLOT(regions, FG_MAX_REGIONS);
    if (i < 0) return -1;
    regions[i].start = (uintptr_t)start;
    regions[i].end = (uintptr_t)start + length;
    bounded_copy(regions[i].message, message, FG_MESSAGE_MAX);
    __atomic_store_n(&regions[i].used, 1, __ATOMIC_RELEASE);
    return i;
}

void fault_guard_remove_region(int slot) {
    if (slot >= 0 && slot < FG_MAX_REGIONS) __atomic_store_n(&regions[slot].used, 0, __ATOMIC_RELEASE);
}

int fault_guard_add_cleanup(const char *path) {
    if (strlen(path) >= FG_PATH_MAX) return -1;
    int i = CLAIM_SLOT(cleanups, FG_MAX_CLEANUPS);
    if (i < 0) return -1;
    memcpy(cleanups[i].path, path, strlen(path) + 1);
    __atomic_store_n(&cleanups[i].used, 1, __ATOMIC_RELEASE);
    return i;
}

void fault_guard_remove_cleanup(int slot) {
    if (slot >= 0 && slot < FG_MAX_CLEANUPS) __atomic_store_n(&cleanups[slot].used, 0, __ATOMIC_RELEASE);
}

void fault_guard_set_note(const char *text) {
    /* the handler may read `note` while this writes it; a torn note is only a garbled tail of the line */
    bounded_copy(note, text, sizeof note);
}
