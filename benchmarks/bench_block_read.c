/* The read bandwidth a decode step can hope for: 2 threads summing 16 KiB blocks of a 128 MiB
   buffer in random order (a paged KV cache: block 16 x 8 KV heads x head dim 32 x float32),
   three ways:
     0 each block front to back;
     1 head by head (the kernel's all-head decode units: 16 rows x 128 bytes, 1 KiB apart,
       then the next head's 128 bytes);
     2 as 1, with every line of the next block prefetched first.

       gcc -O2 -fopenmp benchmarks/bench_block_read.c -o /tmp/bench_block_read
       OMP_NUM_THREADS=2 /tmp/bench_block_read

   Prints GB/s per way (best of 5 passes). Plain C, vectorised by the compiler for any CPU. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NB 8192   /* blocks */
#define BF 4096   /* floats per block: 16 KiB */
#define ROW 256   /* floats per token row: 8 heads x 32 */
#define HD 32     /* floats per head */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float sum_span(const float *p, int n) {
    float s[8] = {0};
    for (int i = 0; i < n; i += 8)
        for (int k = 0; k < 8; k++) s[k] += p[i + k];
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

int main(void) {
    float *buf = aligned_alloc(64, (size_t)NB * BF * sizeof(float));
    int *perm = malloc(NB * sizeof(int));
    if (!buf || !perm) return 1;
    for (size_t i = 0; i < (size_t)NB * BF; i++) buf[i] = (float)(i & 7);
    for (int i = 0; i < NB; i++) perm[i] = i;
    srand(1);
    for (int i = NB - 1; i > 0; i--) {
        const int j = rand() % (i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    const char *names[3] = {"block front to back", "head by head", "head by head + prefetch"};
    for (int way = 0; way < 3; way++) {
        double best = 1e9;
        float total = 0;
        for (int pass = 0; pass < 5; pass++) {
            const double t0 = now();
#pragma omp parallel for reduction(+ : total) schedule(static)
            for (int b = 0; b < NB; b++) {
                const float *p = buf + (size_t)perm[b] * BF;
                if (way == 0) {
                    total += sum_span(p, BF);
                    continue;
                }
                if (way == 2) {
                    const char *n = (const char *)(buf + (size_t)perm[(b + 1) % NB] * BF);
                    for (int l = 0; l < BF * 4; l += 64) __builtin_prefetch(n + l, 0, 2);
                }
                for (int h = 0; h < ROW / HD; h++)
                    for (int r = 0; r < BF / ROW; r++) total += sum_span(p + r * ROW + h * HD, HD);
            }
            const double t = now() - t0;
            if (t < best) best = t;
        }
        printf("%-26s %5.1f GB/s  (checksum %g)\n", names[way], (double)NB * BF * 4 / best / 1e9,
               total);
    }
    free(buf);
    free(perm);
    return 0;
}
