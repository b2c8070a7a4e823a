/* LD_PRELOAD shim for the disk-fault tests (tests/test_disk_cluster.py): fsync and fdatasync
 * fail with EIO once the file named by $MNESITE_FAILSYNC_TRIGGER exists, like a disk whose
 * writeback failed (PostgreSQL's "fsyncgate"). Until then, and without the variable, they are
 * the real calls. Every failed call is counted in $MNESITE_FAILSYNC_TRIGGER.count (appended, one
 * line per call, best effort), so a test can tell that the shim, not something else, failed it.
 *
 * Build: gcc -shared -fPIC -O2 -o failsync.so failsync.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int (*sync_fn)(int);

static int triggered(void) {
    const char *trigger = getenv("MNESITE_FAILSYNC_TRIGGER");
    if (trigger == NULL || trigger[0] == '\0') {
        return 0;
    }
    if (access(trigger, F_OK) != 0) {
        return 0;
    }
    char count_path[4096];
    if (snprintf(count_path, sizeof count_path, "%s.count", trigger) < (int)sizeof count_path) {
        int fd = open(count_path, O_WRONLY | O_APPEND | O_CREAT, 0644);
        if (fd >= 0) {
            ssize_t written = write(fd, "EIO\n", 4);
            (void)written;
            close(fd);
        }
    }
    return 1;
}

static int call_real(const char *name, int fd) {
    sync_fn real = (sync_fn)dlsym(RTLD_NEXT, name);
    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    return real(fd);
}

int fsync(int fd) {
    if (triggered()) {
        errno = EIO;
        return -1;
    }
    return call_real("fsync", fd);
}

int fdatasync(int fd) {
    if (triggered()) {
        errno = EIO;
        return -1;
    }
    return call_real("fdatasync", fd);
}
