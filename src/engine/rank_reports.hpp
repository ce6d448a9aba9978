// Failing together: when one rank's part of a collective call fails locally
// (a refused argument, an allocation, a device error), the other ranks must not
// wait for it until the timeout, and no rank may reach a collective with a size
// the others do not use. So every rank takes part in one fixed-size allgather
// of a RankReport, failed or not, and every rank then throws: the failing rank
// its own error, the others an error of the same code naming the failing rank
// and its reason (docs/errors.md, "One rank's failure fails every rank").
// The same record carries values the ranks must agree on (the state check of
// Reducer, the layout check of add_bucket).
#pragma once

#include <array>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>
#include <vector>

#include "powersgd/comm.hpp"

namespace powersgd::engine {

struct RankReport {
  static constexpr size_t kValues = 12;
  static constexpr size_t kReasonBytes = 240;
  int32_t code = 0;  // 0: this rank's part succeeded; else the ErrorCode of its local failure
  int32_t padding = 0;
  std::array<uint64_t, kValues> values{};
  std::array<char, kReasonBytes> reason{};  // the failure's message, truncated, NUL-terminated

  bool failed() const { return code != 0; }
  std::string reason_text() const;
};

// A report of success carrying `values` (at most kValues).
RankReport report_values(std::initializer_list<uint64_t> values);
// A report of the failure `error` (an Error keeps its code; anything else is Internal).
RankReport report_failure(std::exception_ptr error);

// Collective, fixed size: every rank's report, indexed by rank.
std::vector<RankReport> gather_reports(Communicator& comm, const RankReport& mine);

// When any rank failed, throws on every rank: `own` (this rank's failure) when
// it failed, else an error with the code of the first failing rank, "<what>
// failed on rank k: <reason>" and "; <consequence>" when given. Returns when no rank failed.
void throw_if_any_failed(const std::vector<RankReport>& reports, std::exception_ptr own, const std::string& what,
                         const std::string& consequence = "");

// Throws the Error subclass of `code` with `message`.
[[noreturn]] void throw_error(ErrorCode code, const std::string& message);

}  // namespace powersgd::engine
