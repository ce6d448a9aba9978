// The one doctest entry point of every test binary. Include it, after
// `#define DOCTEST_CONFIG_IMPLEMENT` and <doctest/doctest.h>, in the binary's
// main translation unit only (it registers a listener).
//
// Contract: run_selected_tests() runs the cases that the command line selects
// and fails (exit 1) when a run selects none. Meson registers the multiprocess
// cases by -tc filter strings, so without this a renamed case would drop out of
// CI while its test still passed. Query runs (--list-test-cases, --help, ...)
// select nothing on purpose and keep doctest's own status.
#pragma once

#include <cstdio>

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

inline int run_selected_tests(doctest::Context& context) {
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
