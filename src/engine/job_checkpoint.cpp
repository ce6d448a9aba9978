#include "engine/job_checkpoint.hpp"

#include <algorithm>
#include <array>
#include <cstring>

#include "common/agreed_collectives.hpp"
#include "common/check.hpp"
#include "engine/rank_reports.hpp"

namespace powersgd::engine {

void agree_on_outcome(Communicator& comm, std::exception_ptr local, const std::string& what) {
  // No `own` error: the failing rank gets the same text as the others, so every rank reports the same failure.
  throw_if_any_failed(gather_reports(comm, local ? report_failure(local) : RankReport{}), nullptr, what);
}

void average_error_memories(Communicator& comm, std::vector<CheckpointBucket>& buckets) {
  size_t total = 0;
  for (const auto& b : buckets) total += b.error.size();
  if (total == 0) return;  // no error feedback: the same on every rank (config is checked)
  std::vector<double> sum;
  sum.reserve(total);
  for (const auto& b : buckets) sum.insert(sum.end(), b.error.begin(), b.error.end());
  detail::allreduce_agreed_async(comm, sum.data(), sum.size(), DataType::Float64).wait();
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
  detail::broadcast_agreed_async(comm, &size, sizeof(size), 0).wait();
  bytes.resize(static_cast<size_t>(size));
  if (size > 0) detail::broadcast_agreed_async(comm, bytes.data(), bytes.size(), 0).wait();  // of the size broadcast
  return bytes;
}

}  // namespace powersgd::engine
