#include "engine/rank_reports.hpp"

#include <algorithm>
#include <cstring>

#include "common/agreed_collectives.hpp"
#include "common/check.hpp"

namespace powersgd::engine {

std::string RankReport::reason_text() const {
  return std::string(reason.data(), strnlen(reason.data(), reason.size()));
}

RankReport report_values(std::initializer_list<uint64_t> values) {
  PSGD_ASSERT(values.size() <= RankReport::kValues, values.size(), " values in a rank report");
  RankReport report;
  std::copy(values.begin(), values.end(), report.values.begin());
  return report;
}

RankReport report_failure(std::exception_ptr error) {
  PSGD_ASSERT(error != nullptr, "a failure report without an error");
  RankReport report;
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    report.code = static_cast<int32_t>(e.code());
    message = e.what();
  } catch (const std::exception& e) {
    report.code = static_cast<int32_t>(ErrorCode::Internal);
    message = e.what();
  } catch (...) {
    report.code = static_cast<int32_t>(ErrorCode::Internal);
    message = "an exception that is not a std::exception";
  }
  const size_t n = std::min(message.size(), report.reason.size() - 1);
  std::memcpy(report.reason.data(), message.data(), n);
  return report;
}

std::vector<RankReport> gather_reports(Communicator& comm, const RankReport& mine) {
  std::vector<RankReport> all(static_cast<size_t>(comm.size()));
  detail::allgather_agreed_async(comm, &mine, all.data(), sizeof(RankReport)).wait();
  return all;
}

void throw_if_any_failed(const std::vector<RankReport>& reports, std::exception_ptr own, const std::string& what,
                         const std::string& consequence) {
  const auto failing = std::find_if(reports.begin(), reports.end(), [](const RankReport& r) { return r.failed(); });
  if (failing == reports.end()) return;
  if (own != nullptr) std::rethrow_exception(own);
  const auto count = std::count_if(reports.begin(), reports.end(), [](const RankReport& r) { return r.failed(); });
  throw_error(static_cast<ErrorCode>(failing->code),
              detail::concat(what, " failed on rank ", failing - reports.begin(),
                             count > 1 ? detail::concat(" (and ", count - 1, " other rank(s))") : std::string(), ": ",
                             failing->reason_text(), consequence.empty() ? "" : "; ", consequence));
}

void throw_error(ErrorCode code, const std::string& message) {
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

}  // namespace powersgd::engine
