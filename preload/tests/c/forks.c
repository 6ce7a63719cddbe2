/* Forks while two threads allocate, with fork handlers of an earlier library that allocate
 * (early_atfork.c, linked in); each child allocates too. */
#include <pthread.h>
#include <sys/wait.h>

#include "common.h"

static volatile int stop;

static void *churn(void *arg) {
    size_t len = (size_t)(uintptr_t)arg << 20;
    while (!stop) {
        char *p = malloc(len);
        CHECK(p != NULL, "malloc");
        memset(p, 5, len);
        free(p);
    }
    return NULL;
}

int main(void) {
    pthread_t threads[2];
    for (uintptr_t i = 0; i < 2; i++)
        CHECK(pthread_create(&threads[i], NULL, churn, (void *)(8 + 8 * i)) == 0, "thread");
    for (int i = 0; i < 20; i++) {
        pid_t pid = fork();
        CHECK(pid >= 0, "fork");
        if (pid == 0) {
            char *p = malloc(32 << 20);
            memset(p, 9, 32 << 20);
            free(p);
            _exit(0);
        }
        int status;
        CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && !WEXITSTATUS(status),
              "child %d", i);
    }
    stop = 1;
    for (int i = 0; i < 2; i++) pthread_join(threads[i], NULL);
    printf("20 forks, handlers allocated\n");
    return 0;
}
