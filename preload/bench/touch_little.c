/* Large mallocs a program barely touches (an oversized table, a buffer sized for the worst
 * case): 20 blocks of 8 to 198 MiB, all live, of which each gets a byte written in its first page
 * (`page`) or in every MiB (`mib`), freed at the end. Run with and without the library under
 * LD_PRELOAD: the peak RSS shows whether untouched memory stays overcommitted, as with glibc.
 *
 * usage: touch_little page|mib   prints the MiB asked for, and VmHWM (peak RSS) in MiB */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLOCKS 20

static long vm_hwm_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %ld", &kib) == 1) break;
    if (f) fclose(f);
    return kib;
}

int main(int argc, char **argv) {
    int per_mib = argc > 1 && strcmp(argv[1], "mib") == 0;
    if (argc != 2 || (!per_mib && strcmp(argv[1], "page") != 0)) {
        fprintf(stderr, "usage: touch_little page|mib\n");
        return 2;
    }
    char *blocks[BLOCKS];
    size_t asked = 0;
    for (int i = 0; i < BLOCKS; i++) {
        size_t len = (size_t)(8 + 10 * i) << 20;
        blocks[i] = malloc(len);
        if (!blocks[i]) {
            perror("malloc");
            return 1;
        }
        for (size_t at = 0; at < len; at += per_mib ? (size_t)1 << 20 : len) blocks[i][at] = 1;
        asked += len;
    }
    long hwm = vm_hwm_kib();
    for (int i = 0; i < BLOCKS; i++) free(blocks[i]);
    printf("asked %zu MiB, peak RSS %.1f MiB\n", asked >> 20, hwm / 1024.0);
    return 0;
}
