# cython: language_level=3
"""simd._faultguard: a C SIGBUS handler for memory-mapped files (C in simd/faultguard/fault_guard.c).

A load from a mapped file that another process truncated raises SIGBUS inside C code, where no Python
handler can run. After install(), a SIGBUS whose address lies in a registered region prints that region's
one-line message (prefix + message + note) to stderr, unlinks the registered cleanup paths and exits with
the installed code; any other SIGBUS (a bug) prints a "please report" line and dies as before.

    install(prefix, exit_code)            once per process (the CLIs do it)
    slot = add_region(buf, message)       buf: any readable contiguous buffer (an mmap); -1 when full
    remove_region(slot)
    slot = add_cleanup(path)              a file to unlink on a fatal fault (a temporary output); -1 when full
    remove_cleanup(slot)
    set_note(text)                        appended to the fatal line ("" for none)
"""

cdef extern from "fault_guard.h":
    int fault_guard_install(const char *message_prefix, int exit_code) nogil
    int fault_guard_installed() nogil
    int fault_guard_add_region(const void *start, size_t length, const char *message) nogil
    void fault_guard_remove_region(int slot) nogil
    int fault_guard_add_cleanup(const char *path) nogil
    void fault_guard_remove_cleanup(int slot) nogil
    void fault_guard_set_note(const char *text) nogil


def install(str prefix, int exit_code):
    cdef bytes b = prefix.encode("utf-8", "replace")
    if fault_guard_install(b, exit_code) != 0:
        raise OSError("sigaction(SIGBUS) failed")


def installed():
    return bool(fault_guard_installed())


def add_region(const unsigned char[::1] buf, str message):
    if buf.shape[0] == 0:
        return -1
    cdef bytes m = message.encode("utf-8", "replace")
    return fault_guard_add_region(<const void *>&buf[0], <size_t>buf.shape[0], m)


def remove_region(int slot):
    fault_guard_remove_region(slot)


def add_cleanup(path):
    import os
    cdef bytes p = os.fsencode(path)
    if b"\0" in p:
        return -1
    return fault_guard_add_cleanup(p)


def remove_cleanup(int slot):
    fault_guard_remove_cleanup(slot)


def set_note(str text):
    cdef bytes b = text.encode("utf-8", "replace")
    fault_guard_set_note(b)
