// The C API boundary: every exception becomes a psgd_status here and nowhere
// else; the message goes to a thread-local buffer for psgd_last_error().
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <vector>

#include "capi/config_defaults.hpp"
#include "capi/handles.hpp"
#include "capi/on_store.hpp"
#include "common/check.hpp"
#include "engine/refused_calls.hpp"
#include "powersgd/comm.hpp"
#include "powersgd/powersgd.h"
#include "powersgd/outer_optimizer.hpp"
#include "powersgd/reducer.hpp"
#include "powersgd_build_config.h"

struct psgd_reducer {
  std::unique_ptr<powersgd::Reducer> reducer;
};

namespace {

thread_local std::string g_last_error;
// Where the message itself cannot be allocated (out of host memory): a fixed buffer, so that no exception
// leaves the C boundary (through a C or ctypes caller: std::terminate).
thread_local char g_last_error_fallback[192];
thread_local bool g_last_error_in_fallback = false;

// The last error: "<function>: <prefix><what>". Never throws.
psgd_status fail(psgd_status status, const char* function, const char* prefix, const char* what) noexcept {
  try {
    std::string message = function;
    message.append(": ").append(prefix).append(what);
    g_last_error = std::move(message);
    g_last_error_in_fallback = false;
  } catch (...) {
    std::snprintf(g_last_error_fallback, sizeof g_last_error_fallback, "%s: %s%s", function, prefix, what);
    g_last_error_in_fallback = true;
  }
  return status;
}

// Runs fn, converting every exception into a status and a message.
template <typename Fn>
psgd_status guarded(const char* function, Fn&& fn) noexcept {
  try {
    fn();
    return PSGD_OK;
  } catch (const powersgd::Error& e) {
    return fail(static_cast<psgd_status>(e.code()), function, "", e.what());
  } catch (const std::bad_alloc&) {
    return fail(PSGD_ERR_INTERNAL, function, "", "out of host memory");
  } catch (const std::exception& e) {
    return fail(PSGD_ERR_INTERNAL, function, "unexpected exception: ", e.what());
  } catch (...) {
    return fail(PSGD_ERR_INTERNAL, function, "", "unexpected non-standard exception");
  }
}

#define PSGD_C_NOT_NULL(param) \
  PSGD_REQUIRE((param) != nullptr, InvalidArgumentError, "argument '" #param "' is null")

bool as_bool(int value, const char* field) {
  PSGD_REQUIRE(value == 0 || value == 1, InvalidArgumentError, "config.", field, " = ", value, ": expected 0 or 1");
  return value == 1;
}

// Struct sizes (powersgd.h, "ABI"): each struct's first version's sizeof, where the next version's fields
// start; and a bound far above any struct of a header, so that a garbage struct_size (an uninitialized
// struct) is refused rather than followed into memory.
constexpr size_t kConfigSize01 = 72;
constexpr size_t kStatsSize01 = 48;
constexpr size_t kStoreCallbacksSize02 = 56;
constexpr size_t kMaxStructSize = 4096;
constexpr size_t kMaxBucketTensors = size_t{1} << 24;  // psgd_reducer_add_bucket's num_tensors
static_assert(offsetof(psgd_config, adaptive) == kConfigSize01, "0.2's psgd_config fields start at 0.1's sizeof");
static_assert(offsetof(psgd_stats, last_step_bytes) == kStatsSize01, "0.2's psgd_stats fields start at 0.1's sizeof");
static_assert(offsetof(psgd_store_callbacks, remove) + sizeof(void*) == kStoreCallbacksSize02,
              "psgd_store_callbacks' first version (0.2) ends with remove");

static_assert(PSGD_WIRE_F32 == static_cast<int>(powersgd::WireDType::Float32) &&
                  PSGD_WIRE_BF16 == static_cast<int>(powersgd::WireDType::BFloat16) &&
                  PSGD_WIRE_FP16 == static_cast<int>(powersgd::WireDType::Float16),
              "the C API's wire types are the C++ enum's values");

// A struct the caller allocates (powersgd.h, "ABI"): how its errors name it and the sizes it may have.
struct CallerStruct {
  const char* type;           // "psgd_config"
  const char* size_field;     // how a message names its struct_size: "config.struct_size"
  size_t first_size;          // the sizeof of the struct's first version
  const char* first_version;  // "0.1"
  const char* how;            // how a caller sets struct_size right
};

constexpr CallerStruct kConfigStruct{"psgd_config", "config.struct_size", kConfigSize01, "0.1",
                                     "sizeof(psgd_config); get the config from psgd_config_default() or "
                                     "psgd_config_init()"};
constexpr CallerStruct kStatsStruct{"psgd_stats", "stats.struct_size", kStatsSize01, "0.1",
                                    "sizeof(psgd_stats); declare it as PSGD_STATS_INIT"};
constexpr CallerStruct kStoreCallbacksStruct{"psgd_store_callbacks", "store->struct_size", kStoreCallbacksSize02,
                                             "0.2", "sizeof(psgd_store_callbacks)"};

// The rule for every such struct's size: from the first version's sizeof to kMaxStructSize.
void check_struct_size(const CallerStruct& s, const char* what, size_t size, const char* how = nullptr) {
  PSGD_REQUIRE(size >= s.first_size && size <= kMaxStructSize, InvalidArgumentError, what, " = ", size,
               ": expected at least ", s.first_size, " (powersgd ", s.first_version, "'s sizeof) and at most ",
               kMaxStructSize, " (", how != nullptr ? how : s.how, ")");
}

// A struct the library reads, as this library's T: the first min(struct_size, sizeof(T)) bytes of the
// caller's over `defaults` (an older caller's missing fields). Every byte past sizeof(T) must be 0 (a newer
// header's field at its default): anything else is a setting this version cannot honour.
template <typename T>
T read_caller_struct(const CallerStruct& s, const T* in, T defaults) {
  const size_t size = in->struct_size;
  check_struct_size(s, s.size_field, size);
  T out = defaults;
  std::memcpy(&out, in, std::min(size, sizeof(T)));
  const auto* bytes = reinterpret_cast<const unsigned char*>(in);
  for (size_t i = sizeof(T); i < size; ++i)
    PSGD_REQUIRE(bytes[i] == 0, InvalidArgumentError, s.size_field, " = ", size,
                 ": the struct holds fields this library does not know (powersgd ", PSGD_VERSION, " knows the first ",
                 sizeof(T), " bytes of ", s.type, "; byte ", i, " is ", static_cast<int>(bytes[i]),
                 "): leave fields of a newer header at 0 or use that version's library");
  out.struct_size = sizeof(T);
  return out;
}

// This library's defaults, padding bytes zero.
psgd_config library_defaults() {
  psgd_config c;
  std::memset(&c, 0, sizeof(c));
  const powersgd::Config d;
  c.struct_size = sizeof(c);
  c.rank = d.rank;
  c.start_iter = d.start_iter;
  c.min_compression_rate = d.min_compression_rate;
  c.error_feedback = d.error_feedback ? 1 : 0;
  c.warm_start = d.warm_start ? 1 : 0;
  c.orthogonalization_epsilon = d.orthogonalization_epsilon;
  c.seed = d.seed;
  c.batch_same_shape = d.batch_same_shape ? 1 : 0;
  c.whole_bucket = d.whole_bucket ? 1 : 0;
  c.device = d.device == powersgd::Device::Cpu ? 0 : 1;
  c.device_index = d.device_index;
  c.adaptive = d.adaptive ? 1 : 0;
  c.rank_low = d.rank_low;
  c.rank_high = d.rank_high;
  c.adaptive_interval = d.adaptive_interval;
  c.adaptive_threshold = d.adaptive_threshold;
  c.alternating = d.alternating ? 1 : 0;
  c.divergence_check_interval = d.divergence_check_interval;
  c.warmup_steps = d.warmup_steps;
  c.lr_boost_steps = d.lr_boost_steps;
  c.wire_dtype = static_cast<int>(d.wire_dtype);
  return c;
}

psgd_config read_config(const psgd_config* in) { return read_caller_struct(kConfigStruct, in, library_defaults()); }

powersgd::Config to_config(const psgd_config& c) {
  powersgd::Config config;
  config.rank = c.rank;
  config.start_iter = c.start_iter;
  config.min_compression_rate = c.min_compression_rate;
  config.error_feedback = as_bool(c.error_feedback, "error_feedback");
  config.warm_start = as_bool(c.warm_start, "warm_start");
  config.orthogonalization_epsilon = c.orthogonalization_epsilon;
  config.seed = c.seed;
  config.batch_same_shape = as_bool(c.batch_same_shape, "batch_same_shape");
  config.whole_bucket = as_bool(c.whole_bucket, "whole_bucket");
  PSGD_REQUIRE(c.device == 0 || c.device == 1, InvalidArgumentError, "config.device = ", c.device,
               ": expected 0 (CPU) or 1 (CUDA)");
  config.device = c.device == 0 ? powersgd::Device::Cpu : powersgd::Device::Cuda;
  config.device_index = c.device_index;
  config.adaptive = as_bool(c.adaptive, "adaptive");
  config.rank_low = c.rank_low;
  config.rank_high = c.rank_high;
  config.adaptive_interval = c.adaptive_interval;
  config.adaptive_threshold = c.adaptive_threshold;
  config.alternating = as_bool(c.alternating, "alternating");
  config.divergence_check_interval = c.divergence_check_interval;
  config.warmup_steps = c.warmup_steps;
  config.lr_boost_steps = c.lr_boost_steps;
  config.wire_dtype = static_cast<powersgd::WireDType>(c.wire_dtype);  // validate() names a value out of range
  config.validate();
  return config;
}

}  // namespace

void powersgd::capi::write_config_defaults(void* config, size_t struct_size) noexcept {
  const psgd_config defaults = library_defaults();
  auto* bytes = static_cast<unsigned char*>(config);
  std::memcpy(bytes, &defaults, std::min(struct_size, sizeof(defaults)));
  if (struct_size > sizeof(defaults)) std::memset(bytes + sizeof(defaults), 0, struct_size - sizeof(defaults));
  std::memcpy(bytes, &struct_size, sizeof(struct_size));
}

extern "C" {

const char* psgd_last_error(void) {
  return g_last_error_in_fallback ? g_last_error_fallback : g_last_error.c_str();
}

const char* psgd_version(void) { return PSGD_VERSION; }

psgd_status psgd_comm_init_from_env(psgd_comm** out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(out);
    *out = nullptr;
    auto handle = std::make_unique<psgd_comm>();
    handle->comm = powersgd::Communicator::from_env();
    *out = handle.release();
  });
}

int psgd_comm_rank(const psgd_comm* comm) { return comm == nullptr ? -1 : comm->comm->rank(); }
int psgd_comm_size(const psgd_comm* comm) { return comm == nullptr ? -1 : comm->comm->size(); }

psgd_status psgd_comm_allreduce_sum_f32(psgd_comm* comm, float* data, size_t count) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(comm);
    // A null data is refused by the communicator, which still takes part in the shape exchange.
    comm->comm->allreduce(data, count, powersgd::DataType::Float32);
  });
}

psgd_status psgd_comm_barrier(psgd_comm* comm) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(comm);
    comm->comm->barrier();
  });
}

void psgd_comm_destroy(psgd_comm* comm) { delete comm; }

psgd_status psgd_config_init(psgd_config* config, size_t struct_size) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(config);
    check_struct_size(kConfigStruct, "struct_size", struct_size, "pass sizeof(psgd_config)");
    powersgd::capi::write_config_defaults(config, struct_size);
  });
}

psgd_status psgd_config_validate(const psgd_config* config) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(config);
    (void)to_config(read_config(config));
  });
}

psgd_status psgd_reducer_create(psgd_comm* comm, const psgd_config* config, psgd_reducer** out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(out);
    *out = nullptr;
    PSGD_C_NOT_NULL(comm);
    PSGD_C_NOT_NULL(config);
    auto handle = std::make_unique<psgd_reducer>();
    handle->reducer = std::make_unique<powersgd::Reducer>(*comm->comm, to_config(read_config(config)));
    *out = handle.release();
  });
}

psgd_status psgd_reducer_add_bucket(psgd_reducer* r, size_t num_tensors, const int* ndims, const int64_t* dims,
                                    int* bucket_index) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    std::vector<powersgd::Shape> shapes;
    // Refused here, the bucket is refused collectively all the same: every rank fails at once.
    if (const auto refused = powersgd::detail::exception_of([&] {
          PSGD_C_NOT_NULL(bucket_index);
          PSGD_REQUIRE(num_tensors == 0 || ndims != nullptr, InvalidArgumentError, "argument 'ndims' is null with ",
                       num_tensors, " tensors");
          // Checked before its shapes are allocated: 2^62 tensors is a bad argument, not an out-of-memory.
          PSGD_REQUIRE(num_tensors <= kMaxBucketTensors, InvalidArgumentError, "num_tensors = ", num_tensors,
                       ": expected at most ", kMaxBucketTensors, " tensors in a bucket");
          shapes.resize(num_tensors);
          size_t total_dims = 0;
          for (size_t i = 0; i < num_tensors; ++i) {
            PSGD_REQUIRE(ndims[i] >= 0 && ndims[i] <= 64, InvalidArgumentError, "ndims[", i, "] = ", ndims[i],
                         ": expected 0 to 64");
            total_dims += static_cast<size_t>(ndims[i]);
          }
          PSGD_REQUIRE(total_dims == 0 || dims != nullptr, InvalidArgumentError, "argument 'dims' is null with ",
                       total_dims, " dimensions in ndims");
          size_t next = 0;
          for (size_t i = 0; i < num_tensors; ++i)
            for (int d = 0; d < ndims[i]; ++d) shapes[i].push_back(dims[next++]);
        }))
      powersgd::detail::RefusedCalls::add_bucket(*r->reducer, refused);
    *bucket_index = r->reducer->add_bucket(shapes);
  });
}

psgd_status psgd_reducer_reduce(psgd_reducer* r, int bucket_index, float* data) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    r->reducer->reduce(bucket_index, data);  // refuses a null data on every rank
  });
}

psgd_status psgd_reducer_bucket_size(const psgd_reducer* r, int bucket_index, size_t* size) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(size);
    *size = r->reducer->bucket_size(bucket_index);
  });
}

int64_t psgd_reducer_iteration(const psgd_reducer* r) {
  if (r == nullptr) return -1;
  int64_t result = -1;
  guarded(__func__, [&] { result = r->reducer->iteration(); });
  return result;
}

psgd_status psgd_reducer_error_feedback(const psgd_reducer* r, int bucket_index, float* out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(out);
    r->reducer->error_feedback(bucket_index, out);
  });
}

psgd_status psgd_reducer_stats(const psgd_reducer* r, psgd_stats* out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(out);
    const size_t size = out->struct_size;
    check_struct_size(kStatsStruct, kStatsStruct.size_field, size);
    const powersgd::Stats s = r->reducer->stats();
    psgd_stats result;
    result.struct_size = size;
    result.numel_before = s.numel_before;
    result.numel_after = s.numel_after;
    result.compression_rate = s.compression_rate();
    result.bytes_sent = s.bytes_sent;
    result.relative_error = s.total_relative_error;
    result.last_step_bytes = s.last_step_bytes;
    // A caller's larger struct keeps its later fields; a smaller one gets only what it has.
    std::memcpy(out, &result, std::min(size, sizeof(result)));
  });
}

psgd_status psgd_reducer_bucket_rank(const psgd_reducer* r, int bucket_index, int* rank) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(rank);
    *rank = r->reducer->bucket_rank(bucket_index);
  });
}

psgd_status psgd_reducer_note_lr_change(psgd_reducer* r) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    r->reducer->note_lr_change();
  });
}

psgd_status psgd_reducer_decisions(psgd_reducer* r, int64_t* steps, int* buckets, int* ranks, int* reasons,
                                   size_t capacity, size_t* count) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(count);
    const std::vector<powersgd::RankDecision> taken = r->reducer->decisions(capacity);
    const size_t n = taken.size();
    for (size_t i = 0; i < n; ++i) {
      const powersgd::RankDecision& d = taken[i];
      if (steps != nullptr) steps[i] = d.step;
      if (buckets != nullptr) buckets[i] = d.bucket;
      if (ranks != nullptr) ranks[i] = d.rank;
      if (reasons != nullptr) reasons[i] = static_cast<int>(d.reason);
    }
    *count = n;
  });
}

const char* psgd_rank_reason_name(int reason) {
  if (reason < 0 || reason > static_cast<int>(powersgd::RankReason::NormChangeLow)) return nullptr;
  return powersgd::rank_reason_name(static_cast<powersgd::RankReason>(reason));
}

psgd_status psgd_reducer_save(const psgd_reducer* r, const char* path) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(path);
    r->reducer->save(path);
  });
}

psgd_status psgd_reducer_load(psgd_reducer* r, const char* path) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(path);
    r->reducer->load(path);
  });
}

psgd_status psgd_reducer_load_shared(psgd_reducer* r, const char* path) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(path);
    r->reducer->load_shared(path);
  });
}

// A null path on one rank fails save_job / load_job on every rank (collectively), as their own refusals do.
psgd_status psgd_reducer_save_job(psgd_reducer* r, const char* path) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    if (const auto refused = powersgd::detail::exception_of([&] { PSGD_C_NOT_NULL(path); }))
      powersgd::detail::RefusedCalls::save_job(*r->reducer, refused);
    r->reducer->save_job(path);
  });
}

psgd_status psgd_reducer_load_job(psgd_reducer* r, const char* path) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    if (const auto refused = powersgd::detail::exception_of([&] { PSGD_C_NOT_NULL(path); }))
      powersgd::detail::RefusedCalls::load_job(*r->reducer, refused);
    r->reducer->load_job(path);
  });
}

void psgd_reducer_destroy(psgd_reducer* r) { delete r; }

}  // extern "C"

// ==== Async reduce and the torch.distributed rendezvous (issue 10: the PyTorch DDP comm hook) ====

#include "common/env.hpp"

struct psgd_reduce_handle {
  powersgd::ReduceHandle handle;
};

namespace {

int parse_port(const std::string& name, const std::string& text) {
  int value = 0;
  size_t used = 0;
  try {
    value = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  PSGD_REQUIRE(used == text.size() && used > 0, InvalidArgumentError, "environment variable ", name, "='", text,
               "' is not an integer (expected a TCP port, 1 to 65535)");
  PSGD_REQUIRE(value >= 1 && value <= 65535, InvalidArgumentError, "environment variable ", name, "=", value,
               " is out of range: expected a TCP port, 1 to 65535");
  return value;
}

// The rule of psgd_store_port_beside_torch (powersgd.h).
int store_port_beside_torch() {
  namespace env = powersgd::env;
  if (auto port = env::get("PSGD_STORE_PORT")) return parse_port("PSGD_STORE_PORT", *port);
  auto master_port = env::get("MASTER_PORT");
  PSGD_REQUIRE(master_port.has_value(), InvalidArgumentError,
               "MASTER_PORT is not set: expected the TCP port of torch.distributed's store (powersgd's store uses "
               "MASTER_PORT + 1 unless PSGD_STORE_PORT is set)");
  const int master = parse_port("MASTER_PORT", *master_port);
  auto hosted = env::get("PSGD_STORE_HOSTED");
  if (hosted && *hosted == "1") return master;
  PSGD_REQUIRE(master < 65535, InvalidArgumentError, "MASTER_PORT=", master,
               ": powersgd's store would use MASTER_PORT + 1 = 65536, which is no TCP port; set PSGD_STORE_PORT "
               "to a free port (the same on every rank)");
  return master + 1;
}

// psgd_comm_init_group's rule for a group id.
std::string checked_group_id(const char* group_id) {
  const std::string id = group_id;
  const bool printable = std::all_of(id.begin(), id.end(), [](char c) { return c > ' ' && c <= '~'; });
  PSGD_REQUIRE(!id.empty() && id.size() <= 200 && printable, InvalidArgumentError, "group_id '", id,
               "': expected 1 to 200 printable ASCII characters without spaces");
  return id;
}

// A communicator beside torch, for the whole job or a group of it. Where the job's rank 0 hosts the store
// (torchrun), only the process's first such communicator may host it: a second server on the same port would
// fail to bind. The others use it while its host lives; once the host is destroyed the next one hosts again.
std::unique_ptr<psgd_comm> create_beside_torch(powersgd::CommOptions options) {
  static std::mutex mutex;
  static std::weak_ptr<void> host;
  options.store_port = static_cast<uint16_t>(store_port_beside_torch());
  auto handle = std::make_unique<psgd_comm>();
  if (options.host_store) {
    // Not held during the rendezvous below: a client that starts before the server binds retries until then.
    std::lock_guard lock(mutex);
    if (host.expired()) {
      handle->store_host = std::make_shared<int>(0);
      host = handle->store_host;
    } else {
      options.host_store = false;
    }
  }
  handle->comm = powersgd::Communicator::create(options);
  return handle;
}

// reduce_async's own checks: *out null on failure; a null `out` fails the matching reduction on every rank, as a
// null data does.
void refuse_null_handle(psgd_reducer* r, int bucket_index, psgd_reduce_handle** out) {
  if (out != nullptr) *out = nullptr;
  PSGD_C_NOT_NULL(r);
  if (const auto refused = powersgd::detail::exception_of([&] { PSGD_C_NOT_NULL(out); }))
    powersgd::detail::RefusedCalls::reduce_async(*r->reducer, bucket_index, refused);
}

}  // namespace

extern "C" {

psgd_status psgd_reducer_reduce_async(psgd_reducer* r, int bucket_index, float* data, psgd_reduce_handle** out) {
  return guarded(__func__, [&] {
    refuse_null_handle(r, bucket_index, out);
    auto handle = std::make_unique<psgd_reduce_handle>();  // the reducer refuses a null data on every rank
    handle->handle = r->reducer->reduce_async(bucket_index, data);
    *out = handle.release();
  });
}

psgd_status psgd_reduce_handle_wait(psgd_reduce_handle* h) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(h);
    h->handle.wait();
  });
}

int psgd_reduce_handle_done(const psgd_reduce_handle* h) {
  if (h == nullptr) return -1;
  return h->handle.done() ? 1 : 0;
}

void psgd_reduce_handle_free(psgd_reduce_handle* h) { delete h; }

psgd_status psgd_store_port_beside_torch(int* port) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(port);
    *port = store_port_beside_torch();
  });
}

psgd_status psgd_comm_init_beside_torch(psgd_comm** out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(out);
    *out = nullptr;
    *out = create_beside_torch(powersgd::CommOptions::from_env()).release();
  });
}

psgd_status psgd_comm_broadcast(psgd_comm* comm, void* data, size_t bytes, int root) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(comm);
    // A null data or a bad root is refused by the communicator, which still takes part in the shape exchange.
    comm->comm->broadcast(data, bytes, root);
  });
}

}  // extern "C"

// ==== end of issue 10 additions ====

// ==== A communicator for a torch.distributed subgroup (issue 18, section 4) ====

extern "C" {

psgd_status psgd_comm_init_group(int rank, int size, const char* group_id, psgd_comm** out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(out);
    *out = nullptr;
    PSGD_C_NOT_NULL(group_id);
    const std::string id = checked_group_id(group_id);
    powersgd::CommOptions options = powersgd::CommOptions::from_env();
    PSGD_REQUIRE(size >= 1 && size <= options.world_size, InvalidArgumentError, "group size ", size,
                 ": expected 1 to the job's world size ", options.world_size);
    PSGD_REQUIRE(rank >= 0 && rank < size, InvalidArgumentError, "rank ", rank, " in group '", id,
                 "': expected 0 to ", size - 1);
    // The job's own rank decides who hosts the store (from_env); the group's only its place in the group.
    options.rank = rank;
    options.world_size = size;
    options.run_id = (options.run_id.empty() ? std::string("default") : options.run_id) + "/group/" + id;
    *out = create_beside_torch(std::move(options)).release();
  });
}

}  // extern "C"

// ==== end of issue 18 section 4 additions ====

// ==== Size-checked entry points (issue 18) ====

extern "C" {

psgd_status psgd_reducer_reduce_n(psgd_reducer* r, int bucket_index, float* data, size_t count) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    // A null data goes to the reducer too: the refusal fails the reduction on every rank (a span may not be null).
    if (data == nullptr)
      r->reducer->reduce(bucket_index, data);
    else
      r->reducer->reduce(bucket_index, std::span<float>(data, count));
  });
}

psgd_status psgd_reducer_reduce_async_n(psgd_reducer* r, int bucket_index, float* data, size_t count,
                                        psgd_reduce_handle** out) {
  return guarded(__func__, [&] {
    refuse_null_handle(r, bucket_index, out);
    auto handle = std::make_unique<psgd_reduce_handle>();
    handle->handle = data == nullptr ? r->reducer->reduce_async(bucket_index, data)
                                     : r->reducer->reduce_async(bucket_index, std::span<float>(data, count));
    *out = handle.release();
  });
}

psgd_status psgd_reducer_error_feedback_n(const psgd_reducer* r, int bucket_index, float* out, size_t count) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(out);
    r->reducer->error_feedback(bucket_index, std::span<float>(out, count));
  });
}

}  // extern "C"

// ==== end of issue 18 additions ====

// ==== A communicator on the caller's rendezvous store (issue 22, item 2) ====

extern "C" {

psgd_status psgd_store_value_set(psgd_store_value* value, const void* data, size_t size) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(value);
    PSGD_REQUIRE(data != nullptr || size == 0, InvalidArgumentError, "argument 'data' is null with ", size, " bytes");
    const auto* bytes = static_cast<const char*>(data);
    value->bytes.assign(bytes, bytes + size);
    value->set = true;
  });
}

psgd_status psgd_comm_init_on_store(int rank, int size, const char* group_id, const psgd_store_callbacks* store,
                                    const char* address, psgd_comm** out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(out);
    *out = nullptr;
    PSGD_C_NOT_NULL(store);
    const psgd_store_callbacks callbacks = read_caller_struct(kStoreCallbacksStruct, store, psgd_store_callbacks{});
    std::string run_id = powersgd::env::get_or_default("PSGD_RUN_ID");
    if (run_id.empty()) run_id = "default";
    if (group_id != nullptr) run_id += "/group/" + checked_group_id(group_id);
    auto handle = std::make_unique<psgd_comm>();
    handle->comm = powersgd::capi::create_on_callback_store(rank, size, run_id, callbacks, address);
    *out = handle.release();
  });
}

}  // extern "C"

// ==== end of issue 22 item 2 additions ====

// ==== Timing of the DDP hook's reductions (issue 20, item 3) ====

extern "C" {

psgd_status psgd_reduce_handle_times(const psgd_reduce_handle* h, double* submitted, double* started,
                                     double* finished) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(h);
    PSGD_C_NOT_NULL(submitted);
    PSGD_C_NOT_NULL(started);
    PSGD_C_NOT_NULL(finished);
    const powersgd::ReduceTimes t = h->handle.times();
    *submitted = t.submitted;
    *started = t.started;
    *finished = t.finished;
  });
}

psgd_status psgd_reducer_worker_seconds(const psgd_reducer* r, double* out, size_t count, size_t* known) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(r);
    PSGD_C_NOT_NULL(known);
    PSGD_REQUIRE(out != nullptr || count == 0, InvalidArgumentError, "argument 'out' is null with count ", count);
    const powersgd::Stats s = r->reducer->stats();
    const double seconds[] = {s.compress_seconds, s.communicate_seconds, s.decompress_seconds, s.guard_seconds,
                              s.check_seconds};
    *known = std::size(seconds);
    std::copy_n(seconds, std::min(count, std::size(seconds)), out);
  });
}

}  // extern "C"

// ==== end of issue 20 item 3 additions ====

// ==== Local steps with a compressed outer step (issue 31) ====

struct psgd_outer {
  powersgd::Communicator* comm;      // a refused load's agreement
  const powersgd::Reducer* reducer;  // its bucket sizes
  std::unique_ptr<powersgd::OuterOptimizer> outer;
};

namespace {

void require_bucket_count(const powersgd::Reducer& reducer, size_t count) {
  PSGD_REQUIRE(count == static_cast<size_t>(reducer.num_buckets()), InvalidArgumentError, "num_buckets = ", count,
               ": expected the reducer's bucket count, ", reducer.num_buckets());
}

// The caller's buffers (`count`: the reducer's bucket count, checked first) as spans of their buckets' sizes. A
// null buffer goes to the OuterOptimizer as it is, which has the reducer refuse it on every rank at once.
std::vector<std::span<float>> bucket_spans(const powersgd::Reducer& reducer, float* const* params, size_t count) {
  std::vector<std::span<float>> spans(count);
  for (size_t b = 0; b < count; ++b)
    if (params[b] != nullptr && b < static_cast<size_t>(reducer.num_buckets()))
      spans[b] = std::span<float>(params[b], reducer.bucket_size(static_cast<int>(b)));
  return spans;
}

}  // namespace

extern "C" {

psgd_status psgd_outer_create(psgd_comm* comm, psgd_reducer* r, int64_t local_steps, double lr, double momentum,
                              float* const* params, size_t num_buckets, psgd_outer** out) {
  return guarded(__func__, [&] {
    if (out != nullptr) *out = nullptr;  // first, as every constructor of the C API
    PSGD_C_NOT_NULL(comm);
    // A rank that refuses its arguments still takes part in the construction's agreement: every rank fails.
    if (const auto refused = powersgd::detail::exception_of([&] {
          PSGD_C_NOT_NULL(r);
          PSGD_C_NOT_NULL(params);
          PSGD_C_NOT_NULL(out);
          require_bucket_count(*r->reducer, num_buckets);
        }))
      powersgd::detail::RefusedCalls::outer_create(*comm->comm, refused);
    auto handle = std::make_unique<psgd_outer>();
    handle->comm = comm->comm.get();
    handle->reducer = r->reducer.get();
    handle->outer = std::make_unique<powersgd::OuterOptimizer>(
        *comm->comm, *r->reducer, powersgd::OuterConfig{local_steps, lr, momentum},
        bucket_spans(*r->reducer, params, num_buckets));
    *out = handle.release();
  });
}

psgd_status psgd_outer_step(psgd_outer* o, float* const* params, size_t num_buckets) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(o);
    if (params == nullptr || num_buckets != static_cast<size_t>(o->reducer->num_buckets())) {
      // Every bucket's buffer null: the outer step's Reducer refuses them on every rank at once (a local refusal
      // would leave the others in the step's collectives); this rank then says what it was given. Also for a
      // count other than the buckets', whose buffers are not read (nor a vector of that many made: a count of
      // 2^64 - 1 failed this rank alone, and its next step paired with the others' refusal).
      const std::vector<std::span<float>> none(static_cast<size_t>(o->reducer->num_buckets()));
      try {
        o->outer->step(none);
      } catch (const powersgd::PeerError&) {
        throw;
      } catch (const powersgd::Error&) {
      }
      PSGD_C_NOT_NULL(params);
      require_bucket_count(*o->reducer, num_buckets);
    }
    o->outer->step(bucket_spans(*o->reducer, params, num_buckets));
  });
}

int psgd_outer_due(const psgd_outer* o, int64_t inner_steps) {
  return o == nullptr ? -1 : o->outer->due(inner_steps) ? 1 : 0;
}

psgd_status psgd_outer_start(const psgd_outer* o, int bucket_index, float* out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(o);
    PSGD_C_NOT_NULL(out);
    const std::span<const float> start = o->outer->start(bucket_index);
    std::copy(start.begin(), start.end(), out);
  });
}

int64_t psgd_outer_steps(const psgd_outer* o) { return o == nullptr ? -1 : o->outer->outer_steps(); }

psgd_status psgd_outer_save(const psgd_outer* o, const char* path) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(o);
    PSGD_C_NOT_NULL(path);
    o->outer->save(path);
  });
}

psgd_status psgd_outer_load(psgd_outer* o, const char* path) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(o);
    if (const auto refused = powersgd::detail::exception_of([&] { PSGD_C_NOT_NULL(path); }))
      powersgd::detail::RefusedCalls::outer_load(*o->comm, refused);
    o->outer->load(path);
  });
}

void psgd_outer_destroy(psgd_outer* o) { delete o; }

}  // extern "C"

// ==== end of issue 31 additions ====

// ==== Rounds per step at a distance (issue 28) ====

extern "C" {

psgd_status psgd_comm_communication_rounds(const psgd_comm* comm, uint64_t* out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(comm);
    PSGD_C_NOT_NULL(out);
    *out = comm->comm->communication_rounds();
  });
}

psgd_status psgd_comm_init_channel(const psgd_comm* first, int index, psgd_comm** out) {
  return guarded(__func__, [&] {
    PSGD_C_NOT_NULL(out);
    *out = nullptr;
    PSGD_C_NOT_NULL(first);
    auto handle = std::make_unique<psgd_comm>();
    handle->comm = first->comm->create_channel(index);
    *out = handle.release();
  });
}

}  // extern "C"

// ==== end of issue 28 additions ====
