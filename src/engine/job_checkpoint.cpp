#include "engine/job_checkpoint.hpp"

#include <algorithm>
#include <array>
#include <cstring>

#include "common/check.hpp"

namespace powersgd::engine {
namespace {

// One rank's outcome on the wire: its error code (0: success) and message,
// truncated to a fixed size so every rank passes the same byte count.
struct OutcomeRecord {
  int32_t code = 0;
  std::array<char, 1020> message{};
};
static_assert(sizeof(OutcomeRecord) == 1024);

[[noreturn]] void throw_with_code(ErrorCode code, const std::string& message) {
  switch (code) {
    case ErrorCode::InvalidArgument: throw InvalidArgumentError(message);
    case ErrorCode::Io: throw IoError(message);
    case ErrorCode::Timeout: throw TimeoutError(message);
    case ErrorCode::Mismatch: throw MismatchError(message);
    case ErrorCode::NonFinite: throw NonFiniteError(message);
    case ErrorCode::Unsupported: throw UnsupportedError(message);
    case ErrorCode::Internal: break;
  }
  throw InternalError(message);
}

OutcomeRecord record_of(std::exception_ptr local) {
  OutcomeRecord record;
  if (local == nullptr) return record;
  std::string message;
  try {
    std::rethrow_exception(local);
  } catch (const Error& e) {
    record.code = static_cast<int32_t>(e.code());
    message = e.what();
  } catch (const std::exception& e) {
    record.code = static_cast<int32_t>(ErrorCode::Internal);
    message = e.what();
  } catch (...) {
    record.code = static_cast<int32_t>(ErrorCode::Internal);
    message = "an exception of unknown type";
  }
  std::memcpy(record.message.data(), message.data(), std::min(message.size(), record.message.size() - 1));
  return record;
}

}  // namespace

void agree_on_outcome(Communicator& comm, std::exception_ptr local, const std::string& what) {
  const OutcomeRecord mine = record_of(local);
  std::vector<OutcomeRecord> all(static_cast<size_t>(comm.size()));
  comm.allgather(&mine, all.data(), sizeof(OutcomeRecord));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].code == 0) continue;
    const auto code = all[r].code >= 1 && all[r].code <= static_cast<int32_t>(ErrorCode::Internal)
                          ? static_cast<ErrorCode>(all[r].code)
                          : ErrorCode::Internal;
    all[r].message.back() = '\0';
    throw_with_code(code, detail::concat(what, " failed on rank ", r, " of ", all.size(), ": ", all[r].message.data()));
  }
}

void average_error_memories(Communicator& comm, std::vector<CheckpointBucket>& buckets) {
  size_t total = 0;
  for (const auto& b : buckets) total += b.error.size();
  if (total == 0) return;  // no error feedback: the same on every rank (config is checked)
  std::vector<double> sum;
  sum.reserve(total);
  for (const auto& b : buckets) sum.insert(sum.end(), b.error.begin(), b.error.end());
  comm.allreduce(sum.data(), sum.size(), DataType::Float64);
  const double world = static_cast<double>(comm.size());
  size_t at = 0;
  for (auto& b : buckets)
    for (float& e : b.error) e = static_cast<float>(sum[at++] / world);
}

void write_on_rank0(Communicator& comm, const std::string& path, const std::function<std::vector<char>()>& encode) {
  std::exception_ptr local;
  if (comm.rank() == 0) {
    try {
      write_checkpoint_file(path, encode());
    } catch (...) {
      local = std::current_exception();
    }
  }
  agree_on_outcome(comm, local, "save_job: writing job checkpoint " + path);
}

std::vector<char> read_on_rank0(Communicator& comm, const std::string& path) {
  std::vector<char> bytes;
  std::exception_ptr local;
  if (comm.rank() == 0) {
    try {
      bytes = read_checkpoint_file(path);
    } catch (...) {
      local = std::current_exception();
    }
  }
  agree_on_outcome(comm, local, "load_job: reading job checkpoint " + path);
  uint64_t size = bytes.size();
  comm.broadcast(&size, sizeof(size), 0);
  bytes.resize(static_cast<size_t>(size));
  if (size > 0) comm.broadcast(bytes.data(), bytes.size(), 0);
  return bytes;
}

}  // namespace powersgd::engine
