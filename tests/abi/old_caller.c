/* old_caller: a binary built against the powersgd 0.1 header (tests/abi/v0_1, the 72-byte psgd_config and
 * the 48-byte psgd_stats), run against this libpowersgd.so. Needs RANK=0 WORLD_SIZE=1.
 * 1. psgd_config_default() (0.1's exported symbol) writes exactly the caller's 72 bytes: guard words on
 *    both sides stay untouched, struct_size is 72, every 0.1 field holds its default.
 * 2. The words after the struct are then set to 1 (as a neighbouring variable might be): a library that
 *    read past the 72 bytes would see adaptive = alternating = 1, a valid configuration. A reducer made from
 *    the config must have them off: PowerSGD of rank 2 on a 32 x 24 gradient, one allreduce of P
 *    (32 x 2 floats) and one of Q (24 x 2 floats) each step, so the stats say 112 floats per step.
 * 3. psgd_reducer_stats writes only 0.1's 48 bytes of psgd_stats.
 * Exits 0 when all hold, 1 otherwise, saying what differed. */
#include <stdio.h>
#include <string.h>

#include "powersgd/powersgd.h" /* the 0.1 header: tests/abi/v0_1 is this program's only include directory */

#define GUARD_WORDS 16
#define ROWS 32
#define COLS 24
#define STEPS 3

/* Static, so the layout is fixed: config lies between the two guard arrays. */
static struct {
  int before[GUARD_WORDS];
  psgd_config config;
  int after[GUARD_WORDS];
} g;

static struct {
  psgd_stats stats;
  int after[GUARD_WORDS];
} s;

static int failures = 0;

static void fail(const char* what) {
  fprintf(stderr, "old_caller: %s\n", what);
  ++failures;
}

static int guards_hold(const int* words, const char* where) {
  int i;
  for (i = 0; i < GUARD_WORDS; ++i)
    if (words[i] != 1) {
      fprintf(stderr, "old_caller: guard word %d %s was overwritten: %d (0x%08x), expected 1\n", i, where,
              words[i], (unsigned)words[i]);
      ++failures;
      return 0;
    }
  return 1;
}

static int check(psgd_status status, const char* call) {
  if (status == PSGD_OK) return 1;
  fprintf(stderr, "old_caller: %s failed (%d): %s\n", call, (int)status, psgd_last_error());
  ++failures;
  return 0;
}

int main(void) {
  const int ndims[] = {2};
  const int64_t dims[] = {ROWS, COLS};
  static float grad[ROWS * COLS];
  psgd_comm* comm = NULL;
  psgd_reducer* reducer = NULL;
  int bucket = -1, i, step;

  printf("old_caller: compiled against powersgd %d.%d.%d (sizeof(psgd_config) %u, sizeof(psgd_stats) %u), "
         "running against %s\n", PSGD_VERSION_MAJOR, PSGD_VERSION_MINOR, PSGD_VERSION_PATCH,
         (unsigned)sizeof(psgd_config), (unsigned)sizeof(psgd_stats), psgd_version());

  /* 1. */
  for (i = 0; i < GUARD_WORDS; ++i) g.before[i] = g.after[i] = 1;
  g.config = psgd_config_default();
  guards_hold(g.before, "before the config");
  guards_hold(g.after, "after the config");
  if (g.config.struct_size != sizeof(psgd_config)) {
    fprintf(stderr, "old_caller: config.struct_size = %zu, expected %zu (the caller's sizeof)\n",
            g.config.struct_size, sizeof(psgd_config));
    ++failures;
  }
  if (g.config.rank != 1 || g.config.start_iter != 1000 || g.config.min_compression_rate != 2.0 ||
      g.config.error_feedback != 1 || g.config.warm_start != 1 || g.config.orthogonalization_epsilon != 0.0 ||
      g.config.seed != 0 || g.config.batch_same_shape != 0 || g.config.whole_bucket != 0 || g.config.device != 0 ||
      g.config.device_index != 0)
    fail("psgd_config_default() does not hold 0.1's defaults");

  /* 2. */
  for (i = 0; i < GUARD_WORDS; ++i) g.after[i] = 1;
  g.config.rank = 2;
  g.config.start_iter = 0;
  if (!check(psgd_comm_init_from_env(&comm), "psgd_comm_init_from_env")) return 1;
  if (check(psgd_reducer_create(comm, &g.config, &reducer), "psgd_reducer_create")) {
    if (check(psgd_reducer_add_bucket(reducer, 1, ndims, dims, &bucket), "psgd_reducer_add_bucket")) {
      for (step = 0; step < STEPS; ++step) {
        for (i = 0; i < ROWS * COLS; ++i) grad[i] = (float)((i * 37 + step * 11) % 97) / 97.0f - 0.5f;
        if (!check(psgd_reducer_reduce(reducer, bucket, grad), "psgd_reducer_reduce")) break;
      }
      /* 3. */
      s.stats.struct_size = sizeof(psgd_stats);
      for (i = 0; i < GUARD_WORDS; ++i) s.after[i] = 1;
      if (check(psgd_reducer_stats(reducer, &s.stats), "psgd_reducer_stats")) {
        const unsigned long long per_step = (ROWS + COLS) * 2;
        guards_hold(s.after, "after the stats");
        if (s.stats.struct_size != sizeof(psgd_stats)) fail("psgd_reducer_stats changed struct_size");
        printf("old_caller: %d steps: numel_before %llu, numel_after %llu, bytes_sent %llu\n", STEPS,
               (unsigned long long)s.stats.numel_before, (unsigned long long)s.stats.numel_after,
               (unsigned long long)s.stats.bytes_sent);
        if (s.stats.numel_before != STEPS * ROWS * COLS || s.stats.numel_after != STEPS * per_step) {
          fprintf(stderr, "old_caller: numel_before %llu, numel_after %llu: expected %d and %llu (rank 2, adaptive "
                  "and alternating off: the defaults of the fields 0.1 lacks)\n",
                  (unsigned long long)s.stats.numel_before, (unsigned long long)s.stats.numel_after,
                  STEPS * ROWS * COLS, STEPS * per_step);
          ++failures;
        }
      }
    }
    psgd_reducer_destroy(reducer);
  }
  psgd_comm_destroy(comm);
  if (failures == 0) printf("old_caller: passed\n");
  return failures == 0 ? 0 : 1;
}
