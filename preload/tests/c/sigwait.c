/* A daemon's shape: large buffers set up first, then SIGTERM blocked in every thread of the
 * program and taken with sigwait. The buffers, written whole (populated in bulk, by the
 * library's threads where it has them), must not have started a thread that takes the signal:
 * the process would die of it. With
 * `single` as argument the library is asked for no threads (populate_threads=1), and the
 * process stays single-threaded: unshare(CLONE_NEWUSER) then still works. */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>

#include "common.h"

int main(int argc, char **argv) {
    for (size_t mib = 16; mib <= 256; mib *= 2) {
        char *p = malloc(mib << 20);
        CHECK(p != NULL, "malloc(%zu MiB)", mib);
        memset(p, 1, mib << 20);
        free(p);
    }
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    CHECK(pthread_sigmask(SIG_BLOCK, &term, NULL) == 0, "pthread_sigmask");
    CHECK(kill(getpid(), SIGTERM) == 0, "kill");
    int sig = 0;
    CHECK(sigwait(&term, &sig) == 0 && sig == SIGTERM, "sigwait");
    printf("sigwait took SIGTERM\n");
    if (argc > 1 && !strcmp(argv[1], "single")) {
        CHECK(unshare(CLONE_NEWUSER) == 0, "unshare(CLONE_NEWUSER): %s", strerror(errno));
        printf("unshare(CLONE_NEWUSER) ok\n");
    }
    return 0;
}
