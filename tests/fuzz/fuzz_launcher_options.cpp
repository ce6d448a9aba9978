// libFuzzer target: powersgd-run's inputs (tools/run/options.*, inputs.*). The
// first byte picks what the rest is:
//   0: a hostfile's contents (written to tmpfs, read by parse_hostfile);
//   1: a --hosts list (parse_host_list);
//   2: a command line, NUL-separated words (parse_command_line, which also runs
//      the host, environment and time checks). Command lines naming --log-dir
//      or --hostfile are skipped: the first creates directories, the second
//      could read a device such as /dev/zero; their parsers are fuzzed in 0.
//   3: a --link-rate (parse_rate).
// Parsing may only return or throw powersgd::Error. Hosts that parse are
// checked: none starts with '-' or is empty, every slot count is >= 1.
// Output (help, errors) goes to /dev/null; libFuzzer reports on stderr, which
// stays open (only std::cerr's buffer is replaced).
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "powersgd/error.hpp"
#include "run/options.hpp"

namespace {

void expect(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_launcher_options: property violated: %s\n", what);
    std::abort();
  }
}

void check_hosts(const std::vector<powersgd::run::Host>& hosts) {
  expect(!hosts.empty(), "an empty host list was accepted");
  for (const auto& h : hosts) {
    expect(!h.name.empty() && h.name.front() != '-', "a host name that ssh would read as an option was accepted");
    expect(h.slots >= 1, "a slot count below 1 was accepted");
  }
}

std::string scratch_path() {
  return std::string(::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp") + "/psgd-fuzz-hostfile-" +
         std::to_string(::getpid());
}

std::stringstream discarded;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Help and error text of the parser: not wanted on the terminal 100,000 times a second.
  std::cout.rdbuf(discarded.rdbuf());
  std::cerr.rdbuf(discarded.rdbuf());
  int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (null >= 0) {
    std::fflush(stdout);
    ::dup2(null, 1);  // printf (--version, --print-env)
    ::close(null);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  discarded.str({});
  try {
    switch (data[0] % 4) {
      case 0: {
        const std::string path = scratch_path();
        {
          std::ofstream out(path, std::ios::binary | std::ios::trunc);
          out << text;
        }
        try {
          check_hosts(powersgd::run::parse_hostfile(path));
        } catch (...) {
          std::remove(path.c_str());
          throw;
        }
        std::remove(path.c_str());
        break;
      }
      case 1:
        check_hosts(powersgd::run::parse_host_list(text));
        break;
      case 2: {
        std::vector<std::string> words{"powersgd-run"};
        for (size_t at = 0; at <= text.size();) {
          size_t end = text.find('\0', at);
          if (end == std::string::npos) end = text.size();
          words.push_back(text.substr(at, end - at));
          at = end + 1;
        }
        for (const auto& w : words)
          if (w.find("log-dir") != std::string::npos || w.find("hostfile") != std::string::npos) return -1;
        std::vector<char*> argv;
        for (auto& w : words) argv.push_back(w.data());
        argv.push_back(nullptr);
        auto parsed = powersgd::run::parse_command_line(static_cast<int>(words.size()), argv.data());
        expect(!(parsed.options && parsed.exit_code != 0), "options were returned together with an error exit code");
        if (parsed.options && parsed.options->mode == powersgd::run::Mode::Ssh) check_hosts(parsed.options->hosts);
        if (parsed.options) {
          expect(parsed.options->timeout.count() >= 0 && parsed.options->grace.count() >= 0,
                 "a negative --timeout or --grace was accepted");
          expect(!parsed.options->command.empty(), "options without a program were accepted");
          (void)powersgd::run::place_ranks(*parsed.options);
        }
        break;
      }
      case 3: {
        const uint64_t bits = powersgd::run::parse_rate(text);
        expect(bits >= 8000 && bits <= 100'000'000'000'000ull, "a --link-rate out of range was accepted");
        break;
      }
    }
  } catch (const powersgd::Error&) {
    // refused with a message: the expected outcome for most inputs
  }
  return 0;
}
