/* newer_caller: a binary built against a header newer than this library, whose psgd_config and psgd_stats
 * have fields appended past this library's (two 8-byte fields each), run against libpowersgd.so.
 * Needs RANK=0 WORLD_SIZE=1.
 * 1. psgd_config_init at the larger size writes the defaults, zeros the unknown fields, stamps the size;
 *    it refuses null and sizes below 0.1's or above 4096, naming them, and then writes nothing.
 * 2. psgd_reducer_create accepts the larger struct while the unknown fields are 0, and refuses a non-zero
 *    one with PSGD_ERR_INVALID_ARGUMENT naming struct_size and the unknown fields.
 * 3. psgd_reducer_stats fills the fields it knows and leaves the unknown ones as the caller set them.
 * 4. The header's inline psgd_config_default() stamps this program's sizeof(psgd_config).
 * 5. psgd_config_validate reads the larger struct by the same rule as psgd_reducer_create (zero unknown fields
 *    accepted, a non-zero one refused with the same message), and refuses null.
 * 6. psgd_comm_init_on_store reads a larger psgd_store_callbacks by the same rule: a non-zero unknown field is
 *    refused naming store->struct_size; zero ones are accepted (the call then fails on its rank argument,
 *    which is checked after the struct); a struct_size below the first version's (0.2: 56) is refused.
 * Exits 0 when all hold, 1 otherwise, saying what differed. */
#include <stdio.h>
#include <string.h>

#include "powersgd/powersgd.h"

struct newer_config {
  psgd_config config; /* this library's fields */
  int64_t appended[2];
};

struct newer_stats {
  psgd_stats stats;
  uint64_t appended[2];
};

struct newer_callbacks {
  psgd_store_callbacks callbacks; /* this library's fields */
  uint64_t appended;
};

static int failures = 0;

static void fail(const char* what) {
  fprintf(stderr, "newer_caller: %s\n", what);
  ++failures;
}

/* The call gave `want`, and (on failure) psgd_last_error() contains every needle. */
static void expect(psgd_status got, psgd_status want, const char* call, const char* const* needles) {
  const char* message = psgd_last_error();
  if (got != want) {
    fprintf(stderr, "newer_caller: %s gave status %d, expected %d: %s\n", call, (int)got, (int)want,
            got == PSGD_OK ? "(no error)" : message);
    ++failures;
    return;
  }
  for (; needles != NULL && *needles != NULL; ++needles)
    if (strstr(message, *needles) == NULL) {
      fprintf(stderr, "newer_caller: %s: the message lacks '%s': %s\n", call, *needles, message);
      ++failures;
    }
}

/* Callbacks never called: every call below fails before the rendezvous. */
static int no_set(void* user, const char* key, const void* data, size_t size, char* error, size_t error_size) {
  (void)user, (void)key, (void)data, (void)size, (void)error, (void)error_size;
  return PSGD_ERR_INTERNAL;
}
static int no_get(void* user, const char* key, int64_t timeout_ms, psgd_store_value* value, char* error,
                  size_t error_size) {
  (void)user, (void)key, (void)timeout_ms, (void)value, (void)error, (void)error_size;
  return PSGD_ERR_INTERNAL;
}
static int no_add(void* user, const char* key, int64_t delta, int64_t* result, char* error, size_t error_size) {
  (void)user, (void)key, (void)delta, (void)result, (void)error, (void)error_size;
  return PSGD_ERR_INTERNAL;
}
static int no_wait(void* user, const char* const* keys, size_t count, int64_t timeout_ms, char* error,
                   size_t error_size) {
  (void)user, (void)keys, (void)count, (void)timeout_ms, (void)error, (void)error_size;
  return PSGD_ERR_INTERNAL;
}
static int no_remove(void* user, const char* key, int* existed, char* error, size_t error_size) {
  (void)user, (void)key, (void)existed, (void)error, (void)error_size;
  return PSGD_ERR_INTERNAL;
}

static int all_bytes(const void* p, size_t n, unsigned char value) {
  const unsigned char* b = (const unsigned char*)p;
  size_t i;
  for (i = 0; i < n; ++i)
    if (b[i] != value) return 0;
  return 1;
}

int main(void) {
  static const char* const null_config[] = {"'config'", NULL};
  static const char* const small[] = {"struct_size = 8", "expected at least 72", NULL};
  static const char* const large[] = {"struct_size = 4097", "at most 4096", NULL};
  static const char* const small_stats[] = {"stats.struct_size = 40", "expected at least 48", NULL};
  static const char* const small_store[] = {"store->struct_size = 8", "expected at least 56", NULL};
  static const char* const past_store[] = {"rank 5: expected 0 to 0", NULL};
  char store_size[64], store_byte[64];
  const char* store_unknown[4];
  struct newer_callbacks cb;
  psgd_comm* refused_comm = NULL;
  char unknown_size[64], unknown_byte[64];
  const char* unknown[4];
  const int ndims[] = {2};
  const int64_t dims[] = {32, 24};
  static float grad[32 * 24];
  struct newer_config n;
  struct newer_stats s;
  psgd_config plain;
  psgd_comm* comm = NULL;
  psgd_reducer* reducer = NULL;
  int bucket = -1;

  printf("newer_caller: this library's sizeof(psgd_config) %u, the caller's %u\n", (unsigned)sizeof(psgd_config),
         (unsigned)sizeof n);

  /* 1. */
  memset(&n, 0xA5, sizeof n);
  expect(psgd_config_init(&n.config, sizeof n), PSGD_OK, "psgd_config_init(larger struct)", NULL);
  if (n.config.struct_size != sizeof n) fail("psgd_config_init did not stamp the caller's size");
  if (!all_bytes(n.appended, sizeof n.appended, 0)) fail("psgd_config_init left the unknown fields non-zero");
  if (n.config.rank != 1 || n.config.start_iter != 1000 || n.config.adaptive != 0 || n.config.rank_high != 4 ||
      n.config.alternating != 0)
    fail("psgd_config_init did not write the defaults");
  memset(&plain, 0xA5, sizeof plain);
  expect(psgd_config_init(NULL, sizeof plain), PSGD_ERR_INVALID_ARGUMENT, "psgd_config_init(NULL)", null_config);
  expect(psgd_config_init(&plain, 8), PSGD_ERR_INVALID_ARGUMENT, "psgd_config_init(size 8)", small);
  expect(psgd_config_init(&plain, 4097), PSGD_ERR_INVALID_ARGUMENT, "psgd_config_init(size 4097)", large);
  if (!all_bytes(&plain, sizeof plain, 0xA5)) fail("a refused psgd_config_init wrote into the struct");

  /* 2. */
  expect(psgd_comm_init_from_env(&comm), PSGD_OK, "psgd_comm_init_from_env", NULL);
  if (comm == NULL) return 1;
  n.config.rank = 2;
  n.config.start_iter = 0;
  expect(psgd_reducer_create(comm, &n.config, &reducer), PSGD_OK, "psgd_reducer_create(zero unknown fields)", NULL);
  if (reducer != NULL) {
    expect(psgd_reducer_add_bucket(reducer, 1, ndims, dims, &bucket), PSGD_OK, "psgd_reducer_add_bucket", NULL);
    memset(grad, 0, sizeof grad);
    grad[5] = 1.0f;
    expect(psgd_reducer_reduce(reducer, bucket, grad), PSGD_OK, "psgd_reducer_reduce", NULL);

    /* 3. */
    memset(&s, 0xA5, sizeof s);
    s.stats.struct_size = sizeof s;
    expect(psgd_reducer_stats(reducer, &s.stats), PSGD_OK, "psgd_reducer_stats(larger struct)", NULL);
    if (s.stats.struct_size != sizeof s) fail("psgd_reducer_stats changed struct_size");
    if (s.stats.numel_before != 32 * 24 || s.stats.numel_after != (32 + 24) * 2)
      fail("psgd_reducer_stats: numel_before/numel_after are not one rank-2 step of 32 x 24");
    if (!all_bytes(s.appended, sizeof s.appended, 0xA5)) fail("psgd_reducer_stats wrote past the fields it knows");
    s.stats.struct_size = 40;
    expect(psgd_reducer_stats(reducer, &s.stats), PSGD_ERR_INVALID_ARGUMENT, "psgd_reducer_stats(size 40)",
           small_stats);
    psgd_reducer_destroy(reducer);
    reducer = NULL;
  }

  n.appended[1] = 5; /* byte 0 of the second unknown field, little-endian; at offset sizeof(psgd_config) + 8 */
  snprintf(unknown_size, sizeof unknown_size, "config.struct_size = %u", (unsigned)sizeof n);
  snprintf(unknown_byte, sizeof unknown_byte, "byte %u is 5", (unsigned)(sizeof(psgd_config) + 8));
  unknown[0] = unknown_size;
  unknown[1] = "holds fields this library does not know";
  unknown[2] = unknown_byte;
  unknown[3] = NULL;
  expect(psgd_reducer_create(comm, &n.config, &reducer), PSGD_ERR_INVALID_ARGUMENT,
         "psgd_reducer_create(non-zero unknown field)", unknown);
  if (reducer != NULL) fail("a refused psgd_reducer_create returned a reducer");

  /* 5. */
  expect(psgd_config_validate(&n.config), PSGD_ERR_INVALID_ARGUMENT, "psgd_config_validate(non-zero unknown field)",
         unknown);
  n.appended[1] = 0;
  expect(psgd_config_validate(&n.config), PSGD_OK, "psgd_config_validate(zero unknown fields)", NULL);
  expect(psgd_config_validate(NULL), PSGD_ERR_INVALID_ARGUMENT, "psgd_config_validate(NULL)", null_config);

  /* 6. */
  memset(&cb, 0, sizeof cb);
  cb.callbacks.struct_size = sizeof cb;
  cb.callbacks.set = no_set;
  cb.callbacks.get = no_get;
  cb.callbacks.add = no_add;
  cb.callbacks.wait = no_wait;
  cb.callbacks.remove = no_remove;
  expect(psgd_comm_init_on_store(5, 1, NULL, &cb.callbacks, "127.0.0.1", &refused_comm), PSGD_ERR_INVALID_ARGUMENT,
         "psgd_comm_init_on_store(zero unknown field, rank 5 of 1)", past_store);
  cb.appended = 7;
  snprintf(store_size, sizeof store_size, "store->struct_size = %u", (unsigned)sizeof cb);
  snprintf(store_byte, sizeof store_byte, "byte %u is 7", (unsigned)sizeof(psgd_store_callbacks));
  store_unknown[0] = store_size;
  store_unknown[1] = "holds fields this library does not know";
  store_unknown[2] = store_byte;
  store_unknown[3] = NULL;
  expect(psgd_comm_init_on_store(5, 1, NULL, &cb.callbacks, "127.0.0.1", &refused_comm), PSGD_ERR_INVALID_ARGUMENT,
         "psgd_comm_init_on_store(non-zero unknown field)", store_unknown);
  cb.callbacks.struct_size = 8;
  expect(psgd_comm_init_on_store(0, 1, NULL, &cb.callbacks, "127.0.0.1", &refused_comm), PSGD_ERR_INVALID_ARGUMENT,
         "psgd_comm_init_on_store(struct_size 8)", small_store);
  if (refused_comm != NULL) fail("a refused psgd_comm_init_on_store returned a communicator");

  /* 4. */
  plain = psgd_config_default();
  if (plain.struct_size != sizeof(psgd_config)) fail("psgd_config_default() did not stamp sizeof(psgd_config)");

  psgd_comm_destroy(comm);
  if (failures == 0) printf("newer_caller: passed\n");
  return failures == 0 ? 0 : 1;
}
