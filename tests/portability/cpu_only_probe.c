/* cpu_only_probe: a C program on the C API (powersgd.h) that a CPU-only
 * deployment runs, used by cuda_split.sh in environments where the CUDA module,
 * the CUDA libraries or a GPU are missing (docs/compute.md, "The CUDA module").
 *   cpu_only_probe EXPECTED...
 * 1. A world-size-1 CPU reducer compresses a gradient: the output plus the new
 *    error-feedback memory must give the input plus the previous memory back
 *    (PowerSGD's invariant).
 * 2. A CUDA reducer is asked for: it must fail with PSGD_ERR_UNSUPPORTED and a
 *    message containing every EXPECTED string. The single argument "gpu-or-ok"
 *    instead accepts success (a GPU host) or the "missing a GPU" message.
 * 3. A refused request leaves neither the module nor a CUDA library mapped
 *    (/proc/self/maps), and a second request fails with the same message.
 * 4. The CPU reducer still works after the refused CUDA request.
 * Exits 0 when all hold, 1 otherwise; needs RANK=0 WORLD_SIZE=1. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "powersgd/powersgd.h"

#define ROWS 32
#define COLS 24

static int failed(const char* what, psgd_status status) {
  fprintf(stderr, "cpu_only_probe: %s failed (%d): %s\n", what, (int)status, psgd_last_error());
  return 1;
}

/* The first line of /proc/self/maps naming the CUDA module (or a fake one) or a
 * CUDA library it links, in `line`; 0 when there is none. (The driver,
 * libcuda.so.1, which cudart opens itself on a host that has one, is not
 * ours to unload.) */
static int cuda_mapped(char* line, size_t size) {
  static const char* const names[] = {"libpowersgd-cuda", "fake-module", "libcublas", "libcudart", "libcusolver",
                                      "libnvJitLink"};
  FILE* maps = fopen("/proc/self/maps", "r");
  size_t i;
  if (maps == NULL) {
    snprintf(line, size, "(cannot read /proc/self/maps)");
    return 1;
  }
  while (fgets(line, (int)size, maps) != NULL)
    for (i = 0; i < sizeof names / sizeof names[0]; ++i)
      if (strstr(line, names[i]) != NULL) {
        fclose(maps);
        return 1;
      }
  fclose(maps);
  return 0;
}

/* After a refused CUDA request `first_message`: nothing of CUDA stays mapped, and
 * a second request is refused alike. */
static int check_refusal_unloads(psgd_comm* comm, psgd_config config, psgd_status first_status,
                                 const char* first_message) {
  char line[4096], first[4096];
  psgd_reducer* again = NULL;
  psgd_status status;
  if (cuda_mapped(line, sizeof line)) {
    fprintf(stderr, "cpu_only_probe: the refused CUDA request left this mapped: %s", line);
    return 1;
  }
  snprintf(first, sizeof first, "%s", first_message);
  status = psgd_reducer_create(comm, &config, &again);
  if (status != first_status || strcmp(psgd_last_error(), first) != 0) {
    fprintf(stderr, "cpu_only_probe: a second CUDA request gave %d '%s', the first %d '%s'\n", (int)status,
            status == PSGD_OK ? "(created)" : psgd_last_error(), (int)first_status, first);
    if (status == PSGD_OK) psgd_reducer_destroy(again);
    return 1;
  }
  if (cuda_mapped(line, sizeof line)) {
    fprintf(stderr, "cpu_only_probe: the second refused CUDA request left this mapped: %s", line);
    return 1;
  }
  return 0;
}

/* One compressed step on the CPU: out + new memory == input + previous memory. */
static int cpu_step(psgd_reducer* reducer, int bucket, int step) {
  static float grad[ROWS * COLS], out[ROWS * COLS], memory[ROWS * COLS], previous[ROWS * COLS];
  double worst = 0.0, largest_memory = 0.0;
  size_t i;
  psgd_status status;
  for (i = 0; i < ROWS * COLS; ++i) {
    grad[i] = (float)((i * 37 + (size_t)step * 11) % 97) / 97.0f - 0.5f;
    out[i] = grad[i];
    previous[i] = memory[i];
  }
  if ((status = psgd_reducer_reduce(reducer, bucket, out)) != PSGD_OK) return failed("psgd_reducer_reduce", status);
  if ((status = psgd_reducer_error_feedback(reducer, bucket, memory)) != PSGD_OK)
    return failed("psgd_reducer_error_feedback", status);
  for (i = 0; i < ROWS * COLS; ++i) {
    double diff = fabs((double)out[i] + (double)memory[i] - (double)grad[i] - (double)previous[i]);
    if (!(diff <= worst)) worst = diff; /* NaN counts as the worst */
    if (fabs((double)memory[i]) > largest_memory) largest_memory = fabs((double)memory[i]);
  }
  /* A rank-2 approximation of this 32 x 24 gradient is not exact: no memory means nothing was compressed. */
  if (!(largest_memory > 1e-3)) {
    fprintf(stderr, "cpu_only_probe: step %d: error-feedback memory is %g at most: the gradient was not compressed\n",
            step, largest_memory);
    return 1;
  }
  if (!(worst < 1e-5)) {
    fprintf(stderr, "cpu_only_probe: step %d: |out + memory - grad - previous memory| reaches %g (expected < 1e-5)\n",
            step, worst);
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  const int ndims[] = {2};
  const int64_t dims[] = {ROWS, COLS};
  psgd_comm* comm = NULL;
  psgd_reducer* cpu = NULL;
  psgd_reducer* cuda = NULL;
  psgd_config config = psgd_config_default();
  psgd_status status;
  int bucket = -1, i;
  const char* message;

  if (argc < 2) {
    fprintf(stderr, "usage: cpu_only_probe EXPECTED... | gpu-or-ok\n");
    return 1;
  }
  if ((status = psgd_comm_init_from_env(&comm)) != PSGD_OK) return failed("psgd_comm_init_from_env", status);
  config.rank = 2;
  config.start_iter = 0;
  if ((status = psgd_reducer_create(comm, &config, &cpu)) != PSGD_OK) return failed("CPU psgd_reducer_create", status);
  if ((status = psgd_reducer_add_bucket(cpu, 1, ndims, dims, &bucket)) != PSGD_OK)
    return failed("psgd_reducer_add_bucket", status);
  if (cpu_step(cpu, bucket, 0) != 0) return 1;
  {
    char line[4096];
    if (cuda_mapped(line, sizeof line)) {
      fprintf(stderr, "cpu_only_probe: mapped before any CUDA request: %s", line);
      return 1;
    }
  }

  config.device = 1;
  status = psgd_reducer_create(comm, &config, &cuda);
  message = psgd_last_error();
  if (argc == 2 && strcmp(argv[1], "gpu-or-ok") == 0) {
    if (status == PSGD_OK) {
      printf("cpu_only_probe: CUDA reducer created (a GPU host)\n");
      psgd_reducer_destroy(cuda);
    } else if (status != PSGD_ERR_UNSUPPORTED || strstr(message, "missing a GPU") == NULL) {
      fprintf(stderr, "cpu_only_probe: CUDA request gave %d, expected success or PSGD_ERR_UNSUPPORTED (6) saying "
              "'missing a GPU': %s\n", (int)status, message);
      return 1;
    } else {
      printf("cpu_only_probe: CUDA refused as expected: %s\n", message);
      if (check_refusal_unloads(comm, config, status, message) != 0) return 1;
    }
  } else {
    if (status != PSGD_ERR_UNSUPPORTED) {
      fprintf(stderr, "cpu_only_probe: CUDA request gave %d, expected PSGD_ERR_UNSUPPORTED (6): %s\n", (int)status,
              status == PSGD_OK ? "(created)" : message);
      if (status == PSGD_OK) psgd_reducer_destroy(cuda);
      return 1;
    }
    for (i = 1; i < argc; ++i)
      if (strstr(message, argv[i]) == NULL) {
        fprintf(stderr, "cpu_only_probe: CUDA error message lacks '%s': %s\n", argv[i], message);
        return 1;
      }
    printf("cpu_only_probe: CUDA refused as expected: %s\n", message);
    if (check_refusal_unloads(comm, config, status, message) != 0) return 1;
  }

  if (cpu_step(cpu, bucket, 1) != 0) return 1;
  psgd_reducer_destroy(cpu);
  psgd_comm_destroy(comm);
  printf("cpu_only_probe: CPU reducer passed\n");
  return 0;
}
