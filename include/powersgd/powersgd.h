/* powersgd C API: PowerSGD gradient compression over Gloo, for C and other
 * languages. C99. Wraps the C++ API (powersgd/reducer.hpp) at one boundary:
 * every call returns a psgd_status; on failure psgd_last_error() gives the
 * message (thread-local, valid until the next failing call on this thread).
 * Null pointer arguments return PSGD_ERR_INVALID_ARGUMENT naming the parameter.
 * Objects are used from one thread at a time. Calls marked "Collective" must be
 * made by every rank in the same order. A collective call refused on one rank (an
 * argument out of range, a null pointer) fails on every rank at once, the others
 * naming that rank and its reason, and returns only once its collectives are
 * done: the communicator stays usable for the next call (docs/errors.md).
 *
 * ABI (docs/abi.md): a binary built against an older header keeps working with a later libpowersgd.so.0.
 * The rule for every struct the caller allocates (psgd_config, psgd_stats, psgd_store_callbacks), now and to come:
 * - It begins with `size_t struct_size`, the sizeof the CALLER was compiled with. Only the caller's own
 *   compilation may write it: psgd_config_default() is inline here (it calls psgd_config_init with its
 *   sizeof), psgd_stats is declared as PSGD_STATS_INIT. No function returns such a struct by value from the
 *   library (a struct returned by value is written at the library's size into the caller's smaller one).
 * - Fields are only appended, never reordered, resized or removed, and a version's first appended field
 *   starts at the previous version's sizeof (never in its tail padding).
 * - The library reads (writes) only the first struct_size bytes. A shorter struct (an older caller) gets the
 *   defaults for the fields it lacks; a longer one (a newer caller) must hold zeros in every byte past the
 *   library's sizeof, else PSGD_ERR_INVALID_ARGUMENT ("holds fields this library does not know"). So an
 *   appended field's 0 must mean what libraries without the field do. Output structs (psgd_stats) get the
 *   fields the library knows; bytes past them are left as the caller set them.
 * - A struct_size below the first version's sizeof (or above 4096) is PSGD_ERR_INVALID_ARGUMENT naming it.
 * The library also keeps each symbol an older header declared, with that header's layout: the exported
 * psgd_config_default is 0.1's, returning the 72-byte 0.1 struct with struct_size = 72. */
#ifndef POWERSGD_POWERSGD_H
#define POWERSGD_POWERSGD_H

#include <stddef.h>
#include <stdint.h>

#include "powersgd/export.h"
#include "powersgd/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every declaration of this header is exported: PSGD_API marks each function, and the pragma (one, around
 * the whole header) keeps a function added without the marker from silently disappearing from libpowersgd.so. */
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC visibility push(default)
#endif

typedef enum psgd_status { PSGD_OK = 0, PSGD_ERR_INVALID_ARGUMENT = 1, PSGD_ERR_IO = 2, PSGD_ERR_TIMEOUT = 3,
  PSGD_ERR_MISMATCH = 4, PSGD_ERR_NONFINITE = 5, PSGD_ERR_UNSUPPORTED = 6, PSGD_ERR_INTERNAL = 7 } psgd_status;
PSGD_API const char* psgd_last_error(void);     /* thread-local message of the last failed call on this thread */
/* The library's version, "MAJOR.MINOR.PATCH" (compare with PSGD_VERSION_* of the header compiled against). */
PSGD_API const char* psgd_version(void);

/* The communicator's own collectives (psgd_comm_allreduce_sum_f32, psgd_comm_barrier, psgd_comm_broadcast) run
   at once on the calling thread: they must not overlap a reduction of a reducer on the same communicator still
   in flight (wait for its handles first), or their order against its collectives depends on timing
   (docs/engine.md, "Threads and wire order"). */
typedef struct psgd_comm psgd_comm;
PSGD_API psgd_status psgd_comm_init_from_env(psgd_comm** out);   /* RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, PSGD_* */
PSGD_API int psgd_comm_rank(const psgd_comm* comm);              /* -1 for a null comm */
PSGD_API int psgd_comm_size(const psgd_comm* comm);              /* -1 for a null comm */
PSGD_API psgd_status psgd_comm_allreduce_sum_f32(psgd_comm* comm, float* data, size_t count);  /* Collective, host memory */
PSGD_API psgd_status psgd_comm_barrier(psgd_comm* comm);                                      /* Collective */
PSGD_API void psgd_comm_destroy(psgd_comm* comm);                /* null is a no-op; destroy reducers first (a reducer left over fails with PSGD_ERR_INVALID_ARGUMENT) */

typedef struct psgd_config {
  size_t struct_size;                /* sizeof(psgd_config) as the caller was compiled; set by psgd_config_init */
  int rank;                          /* default 1 */
  int64_t start_iter;                /* default 1000; 0 = compress from the first step */
  double min_compression_rate;       /* default 2.0 */
  int error_feedback;                /* default 1 */
  int warm_start;                    /* default 1 */
  double orthogonalization_epsilon;  /* default 0 */
  uint64_t seed;                     /* default 0 */
  int batch_same_shape;              /* default 0 */
  int whole_bucket;                  /* default 0; 1 = the square-matrix variant */
  int device;                        /* 0 = CPU (default), 1 = CUDA: data pointers are device pointers */
  int device_index;                  /* default 0 */
  /* Appended in 0.2, from offset 72 (a 0.1 caller's struct_size 72 gets their defaults). Adaptive rank
     (docs/engine.md): */
  int adaptive;                      /* default 0; 1 = switch each bucket between rank_low and rank_high (rank unused) */
  int rank_low;                      /* default 1; 1 <= rank_low <= rank_high <= 64 */
  int rank_high;                     /* default 4 */
  int64_t adaptive_interval;         /* default 100 compressed steps per decision; >= 1 */
  double adaptive_threshold;         /* default 0.5; relative norm change at or above it -> rank_high */
  int alternating;                   /* default 0; 1 = one collective per step (alternating power-iteration halves) */
  /* Appended in 0.2 as well (issue 18). Divergence detector (docs/engine.md): every N steps the ranks compare a hash of
     each bucket's output; a difference is PSGD_ERR_MISMATCH on every rank. Default 100; 0 = off; >= 0. */
  int64_t divergence_check_interval;
  /* Appended in 0.2 as well (issue 19). Rank policy (docs/engine.md, "Rank policy and decision log"): the first
     warmup_steps compressed steps of each bucket use the high rank (rank_high; with a fixed rank max(rank,
     rank_high)); after psgd_reducer_note_lr_change, the next lr_boost_steps compressed steps do. Both >= 0. */
  int64_t warmup_steps;              /* default 0 */
  int64_t lr_boost_steps;            /* default 100; 0 = notes change nothing */
  /* Appended (issue 20): the element type of the P and Q factors on the wire (docs/engine.md, "Factors on the
     wire"): PSGD_WIRE_F32 (0, default), PSGD_WIRE_BF16 (1) or PSGD_WIRE_FP16 (2); 16-bit factors halve their
     bytes, the packed uncompressed tensors stay float32. Every rank the same value; CPU only (device 1 with a
     16-bit wire is PSGD_ERR_UNSUPPORTED at psgd_reducer_create). */
  int wire_dtype;
} psgd_config;
#define PSGD_WIRE_F32 0
#define PSGD_WIRE_BF16 1
#define PSGD_WIRE_FP16 2
/* Writes the defaults into the first struct_size bytes of *config (zeros past the fields this library knows)
   and sets config->struct_size = struct_size. Pass sizeof(psgd_config) of the caller's compilation, as
   psgd_config_default() does. PSGD_ERR_INVALID_ARGUMENT for a null config or a struct_size below 72 (0.1's
   sizeof) or above 4096, naming it; *config is then untouched. */
PSGD_API psgd_status psgd_config_init(psgd_config* config, size_t struct_size);
/* Checks *config as psgd_reducer_create does, with no communicator and no side effect: struct_size (the rule
   above), every field's range, and the rules between fields (rank_low <= rank_high; alternating needs
   warm_start; a 16-bit wire_dtype needs device 0). PSGD_OK, or what psgd_reducer_create would return for it:
   PSGD_ERR_INVALID_ARGUMENT (PSGD_ERR_UNSUPPORTED for a 16-bit wire with device 1) with a message naming the
   first field at fault, its value and what is expected ("config.rank = 65: expected 1 to 64"). */
PSGD_API psgd_status psgd_config_validate(const psgd_config* config);
/* The defaults, at this header's size. Inline: the size is the caller's sizeof, never the library's. */
static inline psgd_config psgd_config_default(void) {
  psgd_config config;
  (void)psgd_config_init(&config, sizeof config); /* cannot fail: sizeof config is a valid size */
  return config;
}

typedef struct psgd_reducer psgd_reducer;
/* The reducer keeps a reference to comm: destroy it before comm. Several reducers may share comm: the
   collectives of their calls run in the order the calls were made (a reduce_async of one while another's
   reductions are in flight included), the same on every rank when the calls are made in the same order from
   one thread; reducers used from different threads need a psgd_comm each (docs/engine.md). */
PSGD_API psgd_status psgd_reducer_create(psgd_comm* comm, const psgd_config* config, psgd_reducer** out);
/* Declares the next bucket: num_tensors tensors, tensor i has ndims[i] dimensions, all dimensions concatenated
   in dims; they lie contiguously in that order (num_tensors at most 2^24). *bucket_index receives 0, 1, 2, ...
   Collective. */
PSGD_API psgd_status psgd_reducer_add_bucket(psgd_reducer* r, size_t num_tensors, const int* ndims,
                                             const int64_t* dims, int* bucket_index);
/* In place: this rank's gradients in, the world's averaged (compressed) gradients out. Collective.
   Unchecked: data must hold psgd_reducer_bucket_size floats; psgd_reducer_reduce_n checks the count. Every
   reduction first checks that all ranks reduce the same bucket of the same step (else PSGD_ERR_MISMATCH on every
   rank); an argument refused on one rank fails that reduction on every rank with its reason (docs/errors.md). */
PSGD_API psgd_status psgd_reducer_reduce(psgd_reducer* r, int bucket_index, float* data);
/* Elements (floats) of a bucket's flat buffer: the sum of its tensors' sizes. */
PSGD_API psgd_status psgd_reducer_bucket_size(const psgd_reducer* r, int bucket_index, size_t* size);
PSGD_API int64_t psgd_reducer_iteration(const psgd_reducer* r);  /* completed steps */
/* Copies this rank's error-feedback memory of a bucket (bucket length; zeros before compression starts). */
PSGD_API psgd_status psgd_reducer_error_feedback(const psgd_reducer* r, int bucket_index, float* out);
typedef struct psgd_stats { size_t struct_size; uint64_t numel_before; uint64_t numel_after;
  double compression_rate; uint64_t bytes_sent; double relative_error;
  uint64_t last_step_bytes;  /* appended in 0.2 (offset 48): payload bytes this rank sent in the last completed step */
} psgd_stats;
#define PSGD_STATS_INIT { sizeof(psgd_stats), 0, 0, 0.0, 0, 0.0, 0 }
/* Fills the fields of *out that both this library and out->struct_size know, and no other byte (a newer
   caller's later fields keep their values). struct_size must be set, by PSGD_STATS_INIT (the caller's
   sizeof): at least 48 (0.1's sizeof), at most 4096, else PSGD_ERR_INVALID_ARGUMENT naming it. */
PSGD_API psgd_status psgd_reducer_stats(const psgd_reducer* r, psgd_stats* out);
/* The rank a bucket's compressed matrices use in its next compressed step: config.rank, or with adaptive
   rank_low or rank_high (per matrix min(rows, cols, *rank)). */
PSGD_API psgd_status psgd_reducer_bucket_rank(const psgd_reducer* r, int bucket_index, int* rank);
PSGD_API psgd_status psgd_reducer_save(const psgd_reducer* r, const char* path);
/* Not collective, but due on every rank before the next reduce, from checkpoints of one step: the next reduce
   checks that and returns PSGD_ERR_MISMATCH on every rank, naming the first differing rank, if not. */
PSGD_API psgd_status psgd_reducer_load(psgd_reducer* r, const char* path);
/* Appended in 0.2 (issue 30): loads a per-rank checkpoint (psgd_reducer_save) saved by any rank of a group of
   any size as the state every rank shares: step count, warm-start factors, rank policy; this rank's error
   memory becomes zero (another rank's residual is not this rank's). For one file read by every rank (PyTorch's
   "save on rank 0"). Refusals as psgd_reducer_load (PSGD_ERR_IO, PSGD_ERR_MISMATCH for another configuration
   or layout, or a job file); not collective, but due on every rank from the same file before the next reduce. */
PSGD_API psgd_status psgd_reducer_load_shared(psgd_reducer* r, const char* path);
/* Job checkpoint, resumable on any world size (docs/engine.md). Collective, at a step boundary. save_job: the
   ranks average their error memories and rank 0 alone writes `path` (step count, configuration and layout,
   warm-start state, the mean error memory); every rank returns once the file is durable, and rank 0's write
   error is returned on every rank. load_job, on any number of ranks: rank 0 reads `path` and broadcasts it
   (no shared filesystem needed); every rank takes the mean error memory, the step count and the warm-start
   state. PSGD_ERR_IO (missing, truncated, corrupted) or PSGD_ERR_MISMATCH (another configuration or layout,
   a per-rank file) on every rank, the state unchanged everywhere. */
PSGD_API psgd_status psgd_reducer_save_job(psgd_reducer* r, const char* path);
PSGD_API psgd_status psgd_reducer_load_job(psgd_reducer* r, const char* path);
PSGD_API void psgd_reducer_destroy(psgd_reducer* r);


/* ==== Async reduce and the torch.distributed rendezvous (issue 10: the PyTorch DDP comm hook) ==== */

/* Handle of one in-flight reduction (psgd_reducer_reduce_async). */
typedef struct psgd_reduce_handle psgd_reduce_handle;
/* Starts the in-place reduction of a bucket, as psgd_reducer_reduce, and returns at once with *out set.
   `data` must stay valid and untouched until psgd_reduce_handle_wait returned. Errors found at the start (a
   bad index, a bucket reduced twice in a step, a null out) are returned here, once the other ranks' matching
   reduction failed with them, and *out stays null; errors of the reduction
   itself (a peer lost, NaN/Inf, a timeout) are returned by psgd_reduce_handle_wait. Collective: every rank
   starts the same buckets in the same order. */
PSGD_API psgd_status psgd_reducer_reduce_async(psgd_reducer* r, int bucket_index, float* data, psgd_reduce_handle** out);
/* Blocks until the reduction finished and returns its status; the message is psgd_last_error() of the
   calling thread. Callable from any thread (one that never touches the reducer, e.g. a waiter thread) and
   more than once (same status each time). Never blocks past the communicator's timeout (PSGD_TIMEOUT_MS). */
PSGD_API psgd_status psgd_reduce_handle_wait(psgd_reduce_handle* h);
PSGD_API int psgd_reduce_handle_done(const psgd_reduce_handle* h);  /* 1 finished, 0 in flight, -1 for a null handle */
/* Frees the handle, not the reduction: one not waited for still completes (psgd_reducer_destroy waits for
   it). Null is a no-op. */
PSGD_API void psgd_reduce_handle_free(psgd_reduce_handle* h);

/* Store port of a communicator that lives beside torch.distributed, whose TCPStore holds MASTER_PORT:
   PSGD_STORE_PORT when set; else MASTER_PORT when PSGD_STORE_HOSTED=1 (powersgd-run's store speaks this
   library's protocol); else MASTER_PORT + 1 (an error when MASTER_PORT is 65535 or unset). */
PSGD_API psgd_status psgd_store_port_beside_torch(int* port);
/* As psgd_comm_init_from_env, with the rendezvous store on psgd_store_port_beside_torch(). */
PSGD_API psgd_status psgd_comm_init_beside_torch(psgd_comm** out);

/* Collective: copies `bytes` bytes at data on rank `root` to data on every other rank (host memory). */
PSGD_API psgd_status psgd_comm_broadcast(psgd_comm* comm, void* data, size_t bytes, int root);

/* ==== end of issue 10 additions ==== */

/* ==== Size-checked entry points (issue 18) ==== */
/* As psgd_reducer_reduce, psgd_reducer_reduce_async and psgd_reducer_error_feedback, with the buffer's element
   count: a count other than the bucket's size is PSGD_ERR_INVALID_ARGUMENT naming both (and, for the reduce
   calls, fails that reduction on every rank). */
PSGD_API psgd_status psgd_reducer_reduce_n(psgd_reducer* r, int bucket_index, float* data, size_t count);
PSGD_API psgd_status psgd_reducer_reduce_async_n(psgd_reducer* r, int bucket_index, float* data, size_t count,
                                                 psgd_reduce_handle** out);
PSGD_API psgd_status psgd_reducer_error_feedback_n(const psgd_reducer* r, int bucket_index, float* out,
                                                   size_t count);
/* ==== end of issue 18 additions ==== */

/* ==== A communicator for a torch.distributed subgroup (issue 18, section 4) ==== */

/* Collective over the group's members: a communicator whose ranks are the members of one subgroup of the job
   (e.g. a torch.distributed process group), `rank` of `size` (the member's rank in the group, 0 to size - 1;
   size at most the job's world size). Everything else as psgd_comm_init_beside_torch: the job's store
   (psgd_store_port_beside_torch()), token, transport and timeout from the environment. The members rendezvous
   under the key prefix PSGD_RUN_ID (else "default") + "/group/" + group_id, so groups with different ids never
   meet; every member passes the same group_id (1 to 200 printable ASCII characters, no space), which must name
   the member set (e.g. its sorted global ranks). Where the job's rank 0 hosts the store (PSGD_STORE_HOSTED unset),
   the first communicator that rank creates with this function or psgd_comm_init_beside_torch hosts it, and the
   others of that process use it while it lives: destroy it last. */
PSGD_API psgd_status psgd_comm_init_group(int rank, int size, const char* group_id, psgd_comm** out);

/* ==== end of issue 18 section 4 additions ==== */

/* ==== Timing of the DDP hook's reductions (issue 20, item 3) ==== */
/* When a finished reduction was submitted (psgd_reducer_reduce_async), started on the reducer's worker (after
   the reductions queued before it) and finished, in seconds of the monotonic clock (CLOCK_MONOTONIC on Linux:
   Python's time.monotonic()). PSGD_ERR_INVALID_ARGUMENT for a null argument or a reduction still in flight. */
PSGD_API psgd_status psgd_reduce_handle_times(const psgd_reduce_handle* h, double* submitted, double* started,
                                              double* finished);
/* Cumulative seconds the reducer's worker thread spent, by kind, in this order: compress (local compute before
   and between the collectives), communicate (waiting for the data collectives, host staging included),
   decompress (output and error memory), guard (the order guard's announce collective), check (divergence
   hashes). Writes the first min(count, known) of them to out and the number this library knows to *known
   (5); out may be null when count is 0. Runs after the reductions queued before it. */
PSGD_API psgd_status psgd_reducer_worker_seconds(const psgd_reducer* r, double* out, size_t count, size_t* known);
/* ==== end of issue 20 item 3 additions ==== */

/* ==== A communicator on the caller's rendezvous store (issue 22, item 2) ==== */

/* Where a get callback puts the value it read: psgd_store_value_set copies `size` bytes at `data` (NUL bytes
   included). Valid during that callback only. */
typedef struct psgd_store_value psgd_store_value;
PSGD_API psgd_status psgd_store_value_set(psgd_store_value* value, const void* data, size_t size);
/* A key-value store of the caller's (e.g. torch.distributed's TCPStore or FileStore, under a key prefix), as
   callbacks. Each returns PSGD_OK, PSGD_ERR_TIMEOUT (the key did not appear within timeout_ms) or another
   psgd_status, and on failure may write a NUL-terminated reason into error[0..error_size). Keys are
   NUL-terminated printable strings; values are bytes. The callbacks are called on the thread that calls
   psgd_comm_init_on_store, during that call only. */
typedef struct psgd_store_callbacks {
  size_t struct_size;  /* sizeof(psgd_store_callbacks) of the caller's compilation */
  void* user;          /* passed to every callback */
  int (*set)(void* user, const char* key, const void* data, size_t size, char* error, size_t error_size);
  /* Waits up to timeout_ms for the key, then calls psgd_store_value_set(value, ...) once. */
  int (*get)(void* user, const char* key, int64_t timeout_ms, psgd_store_value* value, char* error,
             size_t error_size);
  /* Adds delta to the integer at key (absent: 0; stored as decimal text) and writes the sum to *result. */
  int (*add)(void* user, const char* key, int64_t delta, int64_t* result, char* error, size_t error_size);
  /* Waits up to timeout_ms until every key exists; timeout_ms 0: checks once without waiting. */
  int (*wait)(void* user, const char* const* keys, size_t count, int64_t timeout_ms, char* error, size_t error_size);
  /* Deletes key; *existed = 1 when it existed, else 0. */
  int (*remove)(void* user, const char* key, int* existed, char* error, size_t error_size);
} psgd_store_callbacks;
/* Collective over `size` processes: a communicator whose ranks rendezvous through the caller's store, so no
   other store, port or launcher variable is needed (MASTER_ADDR, MASTER_PORT, PSGD_STORE_PORT are not read).
   `rank` of `size`; `group_id` NULL for a job of those ranks, else as psgd_comm_init_group's (the members of
   one group pass the same id: keys under PSGD_RUN_ID (else "default") + "/group/" + group_id). `address`: the
   local address the TCP transport binds to when neither PSGD_IFACE nor PSGD_ADDR is set (NULL then: an
   error naming them). Transport, timeout (PSGD_TIMEOUT_MS) and the rest from the environment (docs/env.md).
   The store must be shared by exactly these ranks under these keys: a store key prefix per job keeps jobs
   apart. Errors of a callback become the status it returned, with its reason and the key. */
PSGD_API psgd_status psgd_comm_init_on_store(int rank, int size, const char* group_id,
                                             const psgd_store_callbacks* store, const char* address,
                                             psgd_comm** out);

/* ==== end of issue 22 item 2 additions ==== */

/* ==== Rank policy and decision log (issue 19) ==== */
/* Notes a learning-rate change: from the next step on each bucket's next config.lr_boost_steps compressed steps
   use the high rank. At a step boundary, on every rank before the same step: a note on some ranks only is
   PSGD_ERR_MISMATCH on every rank at the next reduce, naming them, nothing changed, the note still pending. */
PSGD_API psgd_status psgd_reducer_note_lr_change(psgd_reducer* r);
/* The decision log (identical on every rank): writes up to `capacity` of the oldest entries not yet taken into
   the arrays (each of `capacity` elements; any may be null to skip that column) and sets *count to how many;
   they are then taken. Call until *count < capacity. An entry: from step steps[i] on, bucket buckets[i] uses
   rank ranks[i] because of reasons[i] (psgd_rank_reason_name). At most 65536 entries wait between calls. */
PSGD_API psgd_status psgd_reducer_decisions(psgd_reducer* r, int64_t* steps, int* buckets, int* ranks, int* reasons,
                                            size_t capacity, size_t* count);
/* "fixed" (0), "warmup" (1), "lr_note" (2), "first_window" (3), "norm_change_high" (4), "norm_change_low" (5);
   null for another value. */
PSGD_API const char* psgd_rank_reason_name(int reason);
/* ==== end of issue 19 additions ==== */

/* ==== Local steps with a compressed outer step (issue 31; docs/local-steps.md) ==== */
/* DiLoCo's outer optimizer over a reducer (powersgd::OuterOptimizer): every local_steps inner steps each rank
   calls psgd_outer_step; the pseudo-gradients (start point minus parameters) are reduced by `r` in one whole
   step and applied from the synchronised start point with Nesterov momentum, the same bits on every rank.
   params: num_buckets pointers, params[b] holding psgd_reducer_bucket_size(r, b) floats of host memory. */
typedef struct psgd_outer psgd_outer;
/* Collective (after every psgd_reducer_add_bucket of r): rank 0's params are broadcast into every rank's and
   become the start point. local_steps >= 1, lr finite > 0 (DiLoCo: 0.7), 0 <= momentum < 1 (DiLoCo: 0.9); a
   bad value, or a params count other than the reducer's buckets, on one rank fails every rank (the others
   naming it), ranks with other values fail with PSGD_ERR_MISMATCH. A null r, params or out fails every rank
   the same way (the others naming this rank); a null comm is refused on this rank alone. Its collectives take their turn among the communicator's users, after a reduction of any
   reducer still in flight on it. Destroy the psgd_outer before its reducer and its communicator. */
PSGD_API psgd_status psgd_outer_create(psgd_comm* comm, psgd_reducer* r, int64_t local_steps, double lr,
                                       double momentum, float* const* params, size_t num_buckets, psgd_outer** out);
/* Collective: one outer step; on success params hold the new start point. Any failure (a null params[b] or a
   wrong num_buckets, refused on every rank at once; NaN/Inf in any rank's pseudo-gradient: PSGD_ERR_NONFINITE)
   fails every rank and leaves the start point, the momentum, params and r's error memory as they were; r given
   another bucket since psgd_outer_create is refused the same way. An update that would leave the start point
   or the momentum non-finite fails every rank with PSGD_ERR_NONFINITE, those and params unchanged (r's error
   memory took the step's reduction). */
PSGD_API psgd_status psgd_outer_step(psgd_outer* o, float* const* params, size_t num_buckets);
/* 1 when an outer step is due after inner_steps completed inner steps (> 0, a multiple of local_steps), else 0;
   -1 for a null o. */
PSGD_API int psgd_outer_due(const psgd_outer* o, int64_t inner_steps);
/* Copies bucket b's start point (psgd_reducer_bucket_size floats) into out. */
PSGD_API psgd_status psgd_outer_start(const psgd_outer* o, int bucket_index, float* out);
PSGD_API int64_t psgd_outer_steps(const psgd_outer* o);  /* successful outer steps; -1 for a null o */
/* The outer state beside the reducer's checkpoint: save is not collective; load is (every rank, files of one
   checkpoint; a refusal on any rank fails every rank, no state changed). */
PSGD_API psgd_status psgd_outer_save(const psgd_outer* o, const char* path);
PSGD_API psgd_status psgd_outer_load(psgd_outer* o, const char* path);
PSGD_API void psgd_outer_destroy(psgd_outer* o);  /* null is a no-op */
/* ==== end of issue 31 additions ==== */

/* ==== Rounds per step at a distance (issue 28) ==== */
/* Sequential communication rounds of the collectives this communicator ran so far (C++:
   Communicator::communication_rounds; docs/transport.md, "Rounds"): each collective adds the message exchanges
   its algorithm makes one after the other, each at least one one-way network delay (1 for the direct
   allreduce; host-staged, only those that cross hosts). Every collective on the communicator counts: its
   reducers' (the order guard's announce included) and the caller's own. The difference over a training step is
   the rounds on the step's critical path (docs/scaling.md: 2 per compressed reduction where every collective
   took one round and the announce carried P). Not collective: reads a counter, from any thread. A null comm or
   out is PSGD_ERR_INVALID_ARGUMENT. */
PSGD_API psgd_status psgd_comm_communication_rounds(const psgd_comm* comm, uint64_t* out);
/* Collective over first's ranks: a channel (C++: Communicator::create_channel), another communicator of the same
   ranks whose collectives run on a thread and connections of their own, so that a reducer on it overlaps one on
   `first` on the wire (docs/scaling.md, "Channels"). It rendezvouses on first's store under first's key prefix
   + "/channel<index>", with first's settings and direct bound (auto is not measured again); where this process
   hosts that store, keep the communicator that hosts it until every rank's channel is made. `index` 1 to 255,
   the same on every rank, one call per index at a time (ranks whose indices differ: PSGD_ERR_TIMEOUT after the
   timeout); an index whose creation failed is spent. PSGD_ERR_INVALID_ARGUMENT for a null argument or an index
   out of range; PSGD_ERR_UNSUPPORTED where first was made by psgd_comm_init_on_store (make the channel on that
   store with a group id of its own). The channel is destroyed with psgd_comm_destroy, before or after first. */
PSGD_API psgd_status psgd_comm_init_channel(const psgd_comm* first, int index, psgd_comm** out);
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC visibility pop
#endif
/* ==== end of issue 28 additions ==== */

#ifdef __cplusplus
}
#endif

#endif /* POWERSGD_POWERSGD_H */
