/* fault_guard.h: a SIGBUS handler for memory-mapped files (see fault_guard.c). */
#ifndef FAULT_GUARD_H
#define FAULT_GUARD_H
#include <stddef.h>

#define FG_MAX_REGIONS 256
#define FG_MAX_CLEANUPS 32
#define FG_MESSAGE_MAX 1024
#define FG_PATH_MAX 4096

int fault_guard_install(const char *message_prefix, int exit_code);   /* 0 ok, -1 sigaction failed */
int fault_guard_installed(void);
int fault_guard_add_region(const void *start, size_t length, const char *message);  /* slot or -1 (full) */
void fault_guard_remove_region(int slot);
int fault_guard_add_cleanup(const char *path);   /* slot or -1 (full / too long) */
void fault_guard_remove_cleanup(int slot);
void fault_guard_set_note(const char *text);     /* appended to the fatal line, e.g. where a transcript is */
#endif
