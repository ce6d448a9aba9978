// powersgd-run's command line: parsing, validation and the placement of ranks
// on hosts. Everything here runs before any process is started, so every
// problem found is reported as a bad command line (exit 2).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace powersgd::run {

enum class Mode { Local, Ssh, Emulated };

// How --link-delay is applied: netem where the kernel has it (Auto tries it
// first), else the NFQUEUE delayer (tools/delay). docs/launcher.md.
enum class DelayMechanism { Auto, Netem, Nfqueue };

struct Host {
  std::string name;
  int slots = 1;
};

struct SshOptions {
  std::vector<std::string> command{"ssh"};  // --ssh, split on blanks
  int port = 0;                             // 0: ssh's default
  std::string user;
  std::vector<std::string> options;  // each passed as `-o OPTION`
};

struct Options {
  Mode mode = Mode::Local;
  int nproc = 0;  // 0: not given (multi-node: all slots)
  std::vector<Host> hosts;
  SshOptions ssh;
  std::string master_addr;  // empty: chosen by the launcher
  int emulate_hosts = 0;
  uint64_t link_rate_bits = 0;  // 0: links not shaped
  std::chrono::nanoseconds link_delay{0};  // one-way, added inbound on each host's link; 0: none
  DelayMechanism delay_mechanism = DelayMechanism::Auto;
  std::vector<std::pair<std::string, std::string>> env;  // --env K=V, in order
  std::string log_dir;
  std::chrono::milliseconds grace{5000};
  std::chrono::milliseconds timeout{0};  // 0: none
  std::vector<std::string> command;      // PROGRAM ARGS...
};

// Where each rank runs. Ranks are numbered host by host, in host order.
struct Placement {
  int rank = 0;
  int host = 0;  // index into the host list (emulated: namespace index; local: 0)
  int local_rank = 0;
  int local_world_size = 0;
};

// Result of parsing: either options to run, or an exit code to leave with
// (--help, --version, --print-env, or an error already printed).
struct ParseResult {
  std::optional<Options> options;
  int exit_code = 0;
};

ParseResult parse_command_line(int argc, char** argv);

// Exposed for tests and for the parser. All throw InvalidArgumentError naming the bad value.
std::vector<Host> parse_host_list(const std::string& list);  // "h1:4,h2,[::1]:2"
std::vector<Host> parse_hostfile(const std::string& path);   // "host [slots|slots=N]" lines, # comments
uint64_t parse_rate(const std::string& text);                // "200mbit", "1gbit", "500000bit", ...
// A one-way delay: a decimal number with unit ns, us, ms or s ("5ms", "250us", "1.5ms"), or "0";
// 0 to kMaxDelay. `what` names the option in messages ("--link-delay").
std::chrono::nanoseconds parse_delay(const std::string& text, const std::string& what);
inline constexpr std::chrono::seconds kMaxDelay{10};
// "5 ms", "250 us", "1.5 ms": a delay as messages print it.
std::string delay_text(std::chrono::nanoseconds delay);
std::vector<Placement> place_ranks(const Options& options);

// Absolute path of `program` (searched in PATH when it has no '/'); throws
// InvalidArgumentError when it is missing or not an executable file.
std::string resolve_program(const std::string& program);

}  // namespace powersgd::run
