/* load_footprint: what a CPU-only process pays for linking powersgd. Built twice
 * by bench/load_footprint.sh: with -DWITH_POWERSGD (psgd_config_default, a
 * world-size-1 CPU reducer, one compressed step) and without (the same gemm
 * through OpenBLAS alone). Prints the CLOCK_REALTIME nanoseconds at which main
 * started (the runner subtracts its spawn time: the load time) and VmRSS /
 * VmHWM at the end. Needs RANK=0 WORLD_SIZE=1 with powersgd. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <string.h>
#include <time.h>

#ifdef WITH_POWERSGD
#include "powersgd/powersgd.h"
#else
#include <cblas.h>
#endif

#define ROWS 32
#define COLS 24
#define RANK 2

static long status_kb(const char* field) {
  char line[256];
  long value = -1;
  size_t n = strlen(field);
  FILE* f = fopen("/proc/self/status", "r");
  if (f == NULL) return -1;
  while (fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, field, n) == 0 && line[n] == ':') sscanf(line + n + 1, "%ld", &value);
  fclose(f);
  return value;
}

static float grad[ROWS * COLS];

int main(void) {
  struct timespec start;
  size_t i;
  clock_gettime(CLOCK_REALTIME, &start);
  for (i = 0; i < ROWS * COLS; ++i) grad[i] = (float)(i % 97) / 97.0f - 0.5f;
#ifdef WITH_POWERSGD
  {
    const int ndims[] = {2};
    const int64_t dims[] = {ROWS, COLS};
    psgd_comm* comm = NULL;
    psgd_reducer* reducer = NULL;
    psgd_config config = psgd_config_default();
    int bucket = -1;
    config.rank = RANK;
    config.start_iter = 0;
    if (psgd_comm_init_from_env(&comm) != PSGD_OK || psgd_reducer_create(comm, &config, &reducer) != PSGD_OK ||
        psgd_reducer_add_bucket(reducer, 1, ndims, dims, &bucket) != PSGD_OK ||
        psgd_reducer_reduce(reducer, bucket, grad) != PSGD_OK) {
      fprintf(stderr, "load_footprint: %s\n", psgd_last_error());
      return 1;
    }
    psgd_reducer_destroy(reducer);
    psgd_comm_destroy(comm);
  }
#else
  {
    static float q[COLS * RANK], p[ROWS * RANK];
    for (i = 0; i < COLS * RANK; ++i) q[i] = (float)i / (COLS * RANK);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ROWS, RANK, COLS, 1.0f, grad, COLS, q, RANK, 0.0f, p,
                RANK);
    if (p[0] != p[0]) return 1;
  }
#endif
  printf("main_ns=%lld rss_kb=%ld hwm_kb=%ld\n", (long long)start.tv_sec * 1000000000LL + start.tv_nsec,
         status_kb("VmRSS"), status_kb("VmHWM"));
  return 0;
}
