/* c_demo: PowerSGD from C through powersgd.h only. Every rank builds the same
 * small "model" (two layers), reduces synthetic gradients for a few steps and
 * rank 0 prints what the reducer reports. Run it with
 *   powersgd-run -n 2 -- ./c_demo
 * or alone with RANK=0 WORLD_SIZE=1 ./c_demo. */
#include <stdio.h>
#include <stdlib.h>

#include "powersgd/powersgd.h"

#define CHECK_OK(call)                                                         \
  do {                                                                         \
    psgd_status status_ = (call);                                              \
    if (status_ != PSGD_OK) {                                                  \
      fprintf(stderr, "c_demo: %s failed (%d): %s\n", #call, (int)status_,     \
              psgd_last_error());                                              \
      return 1;                                                                \
    }                                                                          \
  } while (0)

int main(void) {
  /* Tensors: a 64 x 128 weight, its 64 biases, a 32 x 16 x 3 x 3 convolution. */
  const int ndims[] = {2, 1, 4};
  const int64_t dims[] = {64, 128, 64, 32, 16, 3, 3};
  const size_t count = 64 * 128 + 64 + 32 * 16 * 3 * 3;
  psgd_comm* comm = NULL;
  psgd_reducer* reducer = NULL;
  psgd_config config = psgd_config_default();
  psgd_stats stats = PSGD_STATS_INIT;
  int bucket = -1;
  size_t bucket_size = 0;
  int step;
  size_t i;
  float* grad = malloc(count * sizeof(float));
  if (grad == NULL) return 1;

  CHECK_OK(psgd_comm_init_from_env(&comm));
  config.rank = 2;
  config.start_iter = 2;
  CHECK_OK(psgd_reducer_create(comm, &config, &reducer));
  CHECK_OK(psgd_reducer_add_bucket(reducer, 3, ndims, dims, &bucket));
  CHECK_OK(psgd_reducer_bucket_size(reducer, bucket, &bucket_size));
  if (bucket_size != count) {
    fprintf(stderr, "c_demo: bucket of %zu floats, expected %zu\n", bucket_size, count);
    return 1;
  }
  for (step = 0; step < 10; ++step) {
    for (i = 0; i < count; ++i)
      grad[i] = (float)((i * 7 + (size_t)step * 13 + (size_t)psgd_comm_rank(comm) * 31) % 101) / 101.0f - 0.5f;
    CHECK_OK(psgd_reducer_reduce(reducer, bucket, grad));
  }
  CHECK_OK(psgd_reducer_stats(reducer, &stats));
  if (psgd_comm_rank(comm) == 0)
    printf("c_demo: powersgd %s (header %d.%d.%d)\n", psgd_version(), PSGD_VERSION_MAJOR, PSGD_VERSION_MINOR,
           PSGD_VERSION_PATCH);
  if (psgd_comm_rank(comm) == 0)
    printf("c_demo: %d rank(s), %lld steps, compression %.1fx, %llu bytes sent, relative error %.3f\n",
           psgd_comm_size(comm), (long long)psgd_reducer_iteration(reducer), stats.compression_rate,
           (unsigned long long)stats.bytes_sent, stats.relative_error);
  /* A bad argument is reported, not fatal. */
  if (psgd_reducer_reduce(reducer, 7, grad) != PSGD_ERR_INVALID_ARGUMENT) return 1;
  if (psgd_comm_rank(comm) == 0) printf("c_demo: expected error: %s\n", psgd_last_error());
  psgd_reducer_destroy(reducer);
  psgd_comm_destroy(comm);
  free(grad);
  return 0;
}
