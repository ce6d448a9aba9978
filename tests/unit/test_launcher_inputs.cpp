// powersgd-run's input checks (tools/run/inputs.*, options.*) in one process:
// host names, forwarded environment names, poll's wait and log files.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "powersgd/error.hpp"
#include "run/inputs.hpp"
#include "run/options.hpp"

namespace {

namespace fs = std::filesystem;
using namespace powersgd;
using namespace std::chrono_literals;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "psgd-inputs-test-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("host names: DNS names and IPv4/IPv6 addresses pass; options and metacharacters are refused") {
  for (const char* ok : {"node1", "node-1.cluster.example", "10.0.0.1", "::1", "fe80::1%eth0", "a_b"})
    CHECK_NOTHROW(run::validate_host_name(ok, "test"));
  CHECK(message_of([] { run::validate_host_name("-oProxyCommand=x", "hostfile h line 2"); }) ==
        "hostfile h line 2: host name '-oProxyCommand=x' starts with '-' (ssh would read it as an option): expected "
        "a host name or address");
  for (const char* bad : {"a b", "a\tb", "a;b", "a$(x)", "a`x`", "a'b", "a/b", "user@node", "a\nb"})
    CHECK_THROWS_AS(run::validate_host_name(bad, "test"), InvalidArgumentError);
  CHECK(message_of([] { run::validate_host_name(std::string("a\x1b[2Jb"), "test"); }).find("'a\\x1b[2Jb'") !=
        std::string::npos);  // control characters are shown escaped, never sent to the terminal
  CHECK(run::parse_host_list("node1:2,[::1]:3,10.0.0.2").size() == 3);
  CHECK_THROWS_AS(run::parse_host_list("node1,-x:2"), InvalidArgumentError);
  CHECK_THROWS_AS(run::parse_host_list("[-oProxyCommand=x]:2"), InvalidArgumentError);
}

TEST_CASE("forwarded environment: names must be shell identifiers, values one line") {
  CHECK(run::is_shell_identifier("PSGD_TOKEN"));
  CHECK(run::is_shell_identifier("_x9"));
  for (const char* bad : {"", "9A", "PSGD_A-B", "PSGD A", "PSGD_\xc3\xa9", "A=B"})
    CHECK_FALSE(run::is_shell_identifier(bad));
  CHECK_NOTHROW(run::validate_forwarded_environment({{"PSGD_A", "x y 'z'"}}));
  CHECK(message_of([] { run::validate_forwarded_environment({{"PSGD_A-B", "1"}}); })
            .find("environment variable 'PSGD_A-B' cannot be passed to ssh workers") != std::string::npos);
  CHECK_THROWS_AS(run::validate_forwarded_environment({{"PSGD_A", "1\n2"}}), InvalidArgumentError);
}

TEST_CASE("poll's wait: never negative, never above INT_MAX ms, rounded up") {
  CHECK(run::poll_timeout_ms(-5s) == 0);
  CHECK(run::poll_timeout_ms(0ns) == 0);
  CHECK(run::poll_timeout_ms(1ns) == 1);
  CHECK(run::poll_timeout_ms(1500us) == 2);
  CHECK(run::poll_timeout_ms(std::chrono::hours(24 * 30)) == 2147483647);  // 30 days wrapped negative before
  CHECK(run::poll_timeout_ms(std::chrono::nanoseconds::max()) == 2147483647);
}

TEST_CASE("log files: created 0600 and truncated; links, FIFOs and hard links are refused and left as they were") {
  TempDir dir;
  const fs::path file = dir.path / "rank-0.out";
  std::ofstream(file) << "old contents";
  fs::permissions(file, fs::perms::all);
  int fd = run::open_log_file(file.string());
  REQUIRE(fd >= 0);
  struct stat st {};
  REQUIRE(::fstat(fd, &st) == 0);
  CHECK((st.st_mode & 07777) == 0600);
  CHECK(st.st_size == 0);
  ::close(fd);

  const fs::path victim = dir.path / "victim";
  std::ofstream(victim) << "precious";
  fs::create_symlink(victim, dir.path / "link.out");
  CHECK(message_of([&] { run::open_log_file((dir.path / "link.out").string()); }).find("symbolic link") !=
        std::string::npos);
  fs::create_hard_link(victim, dir.path / "hard.out");
  CHECK(message_of([&] { run::open_log_file((dir.path / "hard.out").string()); }).find("other hard links") !=
        std::string::npos);
  REQUIRE(::mkfifo((dir.path / "fifo.out").c_str(), 0600) == 0);
  CHECK(message_of([&] { run::open_log_file((dir.path / "fifo.out").string()); }).find("not a regular file") !=
        std::string::npos);
  CHECK(fs::file_size(victim) == 8);
}

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }

// Found by fuzz_launcher_options: "--hosts node1:333333333" without -n asked for
// 333 million workers and place_ranks ran out of memory placing them.
TEST_CASE("worker count: -n and the slots of --hosts are bounded, the sum of slots does not overflow") {
  auto parse = [](std::vector<std::string> words) {
    words.insert(words.begin(), "powersgd-run");
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    return run::parse_command_line(static_cast<int>(words.size()), argv.data());
  };
  CHECK_FALSE(parse({"--hosts", "node1:333333333", "--", "true"}).options);
  CHECK_FALSE(parse({"--hosts", "a:2000000000,b:2000000000", "--", "true"}).options);  // sum above INT_MAX
  CHECK_FALSE(parse({"-n", "2000000000", "--", "true"}).options);
  const auto bounded = parse({"--hosts", "node1:333333333", "-n", "4", "--", "true"});
  REQUIRE(bounded.options);
  CHECK(run::place_ranks(*bounded.options).size() == 4);
  const auto local = parse({"-n", "3", "--", "true"});
  REQUIRE(local.options);
  CHECK(run::place_ranks(*local.options).size() == 3);
}

TEST_CASE("--link-delay: units ns, us, ms, s and a bare 0; negative, unit-less, unknown units and absurd values are refused") {
  using std::chrono::nanoseconds;
  CHECK(run::parse_delay("5ms", "--link-delay") == nanoseconds(5'000'000));
  CHECK(run::parse_delay("250us", "--link-delay") == nanoseconds(250'000));
  CHECK(run::parse_delay("1.5ms", "--link-delay") == nanoseconds(1'500'000));
  CHECK(run::parse_delay("10s", "--link-delay") == nanoseconds(10'000'000'000));
  CHECK(run::parse_delay("7ns", "--link-delay") == nanoseconds(7));
  CHECK(run::parse_delay("0", "--link-delay") == nanoseconds(0));
  CHECK(run::parse_delay("0ms", "--link-delay") == nanoseconds(0));
  CHECK(message_of([] { run::parse_delay("-5ms", "--link-delay"); }) ==
        "--link-delay '-5ms' is negative: expected a one-way delay of 0 or more, e.g. 5ms");
  CHECK(message_of([] { run::parse_delay("5", "--delay"); }) ==
        "--delay '5' is not a delay: expected a number with unit ns, us, ms or s (e.g. 5ms, 250us), or 0");
  for (const char* bad : {"", "ms", "5 ms", "5MS", "5min", "1e3ms", "inf", "nan", "5ms5", "..ms", "0x5ms"})
    CHECK_THROWS_AS(run::parse_delay(bad, "--link-delay"), InvalidArgumentError);
  CHECK(message_of([] { run::parse_delay("10.001s", "--link-delay"); }) ==
        "--link-delay '10.001s' is out of range: expected 0 to 10s one way");
  CHECK_THROWS_AS(run::parse_delay("99999999999999999999999s", "--link-delay"), InvalidArgumentError);
  CHECK(run::delay_text(nanoseconds(5'000'000)) == "5 ms");
  CHECK(run::delay_text(nanoseconds(250'000)) == "250 us");
  CHECK(run::delay_text(nanoseconds(0)) == "0");
}

// Found by fuzz_launcher_options: a host named twice had its slots summed in int
// (1960000000 + 980000000 overflowed: UBSan aborted; a release build went on with
// a negative slot count and powersgd-run died of SIGSEGV).
TEST_CASE("a host named twice: its slots are summed without overflow, a sum above INT_MAX is refused") {
  CHECK(message_of([] { run::parse_host_list("127.0.0.1:1960000000,127.0.0.1:980000000"); }) ==
        "--hosts entry '127.0.0.1:980000000': host '127.0.0.1' named again, its slots 1960000000 + 980000000 = "
        "2940000000 are out of range: expected at most 2147483647 slots per host");
  CHECK(message_of([] { run::parse_host_list("a:2147483647,a"); }).find("2147483647 + 1 = 2147483648") !=
        std::string::npos);
  const auto merged = run::parse_host_list("a:2147483646,b:3,a");
  REQUIRE(merged.size() == 2);
  CHECK(merged[0].slots == 2147483647);
  CHECK(merged[1].slots == 3);
  CHECK(message_of([] { run::parse_host_list("a:3000000000"); }) ==
        "--hosts entry 'a:3000000000': slot count '3000000000' is out of range: expected 1 to 2147483647");
  CHECK(message_of([] { run::parse_host_list("a:-3000000000"); }).find("is not a positive integer") !=
        std::string::npos);

  TempDir dir;
  const fs::path hostfile = dir.path / "hosts";
  std::ofstream(hostfile) << "node1 slots=1960000000\n# again\nnode1 980000000\n";
  CHECK(message_of([&] { run::parse_hostfile(hostfile.string()); }) ==
        "hostfile " + hostfile.string() +
            " line 3: host 'node1' named again, its slots 1960000000 + 980000000 = 2940000000 are out of range: "
            "expected at most 2147483647 slots per host");

  // The command line of the issue: refused (exit 2) instead of a crash.
  std::vector<std::string> words{"powersgd-run", "--hosts", "127.0.0.1:1960000000,127.0.0.1:980000000", "--", "true"};
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  const auto parsed = run::parse_command_line(static_cast<int>(words.size()), argv.data());
  CHECK_FALSE(parsed.options);
  CHECK(parsed.exit_code == 2);
}
