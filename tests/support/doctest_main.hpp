// The one doctest entry point of every test binary. Include it, after
// `#define DOCTEST_CONFIG_IMPLEMENT` and <doctest/doctest.h>, in the binary's
// main translation unit only (it registers a listener).
//
// Contract: run_selected_tests() runs the cases that the command line selects
// and fails (exit 1) when a run selects none. Meson registers the multiprocess
// cases by -tc filter strings, so without this a renamed case would drop out of
// CI while its test still passed. Query runs (--list-test-cases, --help, ...)
// select nothing on purpose and keep doctest's own status.
//
// Pretend hosts: with PSGD_TEST_HOSTS set to one host name per rank, comma-separated
// ("a,a,b,b"), run_selected_tests() first sets this rank's PSGD_HOST_ID (indexed
// by RANK), so that Meson can split loopback ranks into hosts for the
// host-staged allreduce (PSGD_HOST_STAGE=1, or auto: the default) by environment alone.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace powersgd::testing {

struct SelectionCounter : doctest::IReporter {
  static inline unsigned selected = 0;
  static inline bool queried = false;

  explicit SelectionCounter(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override { queried = true; }
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override { selected = stats.numTestCasesPassingFilters; }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("selection-counter", 1, SelectionCounter);

// The host names of PSGD_TEST_HOSTS, one per rank; empty when unset.
inline std::vector<std::string> pretend_hosts() {
  std::vector<std::string> hosts;
  const char* list = std::getenv("PSGD_TEST_HOSTS");
  if (list == nullptr) return hosts;
  std::string text = list;
  for (size_t start = 0;;) {
    size_t comma = text.find(',', start);
    hosts.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return hosts;
    start = comma + 1;
  }
}

// Sets PSGD_HOST_ID from PSGD_TEST_HOSTS; false (with a message) when the list does not fit the world.
inline bool apply_pretend_hosts() {
  const auto hosts = pretend_hosts();
  if (hosts.empty()) return true;
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank == nullptr || world == nullptr || static_cast<size_t>(std::atoi(world)) != hosts.size()) {
    std::fprintf(stderr, "test: PSGD_TEST_HOSTS names %zu hosts for WORLD_SIZE=%s\n", hosts.size(),
                 world != nullptr ? world : "(unset)");
    return false;
  }
  const int me = std::atoi(rank);
  if (me < 0 || static_cast<size_t>(me) >= hosts.size()) {
    std::fprintf(stderr, "test: RANK=%s is outside the %zu hosts of PSGD_TEST_HOSTS\n", rank, hosts.size());
    return false;
  }
  setenv("PSGD_HOST_ID", hosts[static_cast<size_t>(me)].c_str(), 1);
  return true;
}

inline int run_selected_tests(doctest::Context& context) {
  if (!apply_pretend_hosts()) return 1;
  int status = context.run();
  if (status == 0 && !SelectionCounter::queried && !context.shouldExit() && SelectionCounter::selected == 0) {
    std::fprintf(stderr, "test: the command line selected no test case (a -tc/-ts filter that matches nothing?)\n");
    return 1;
  }
  return status;
}

inline int run_selected_tests(int argc, char** argv) {
  doctest::Context context(argc, argv);
  return run_selected_tests(context);
}

}  // namespace powersgd::testing
