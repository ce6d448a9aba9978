#include "options.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>

#include "common/check.hpp"
#include "common/env.hpp"
#include "inputs.hpp"
#include "powersgd_build_config.h"

namespace powersgd::run {
namespace {

constexpr const char* kDescription =
    "powersgd-run: start the workers of a powersgd job, host its rendezvous store, relay their output "
    "and stop them all when one fails.";

constexpr const char* kFooter = R"(
MODES
  Local (one machine):
      powersgd-run -n 4 -- ./train --epochs 3
  Multi-node over ssh (ranks are numbered host by host, in order):
      powersgd-run --hosts node1:4,node2:4 -- /shared/train
      powersgd-run --hostfile hosts.txt --ssh-user alice --ssh-option IdentityFile=~/.ssh/id_job -- /shared/train
    The hostfile has one "host [slots]" (or "host slots=N") per line; '#' starts a comment.
    Remote workers start in the launcher's working directory when it exists there (else the login
    directory). Each runs under a small sh wrapper that reads the job environment from the ssh
    connection's stdin and kills the worker when that stdin reaches EOF, so a remote worker dies
    when its ssh connection closes (launcher killed, network lost). The store listens on all
    interfaces (127.0.0.1 when every host is a loopback name); workers reach it at --master-addr,
    by default the address this machine uses to reach the first host.
  Emulated cluster on one machine (needs root: CAP_NET_ADMIN and CAP_SYS_ADMIN):
      powersgd-run --emulate-hosts 4 --link-rate 1gbit -n 8 -- ./train
    Creates network namespaces psgd-<pid>-h0 ... (the emulated hosts, addresses 10.77.0.1 ...) and
    psgd-<pid>-br, which holds a bridge joining them (address 10.77.0.254) and the store. Each host's
    link is shaped with tbf to RATE in both directions (units bit, kbit, mbit, gbit, tbit; decimal;
    without --link-rate links are not shaped). --link-delay DELAY (ns, us, ms, s; e.g. 5ms) delays
    the traffic into each host by DELAY, so a round trip between two hosts takes 2 x DELAY: with netem
    where the kernel has it, else with powersgd-delay (an NFQUEUE delayer, one per host namespace,
    fed by an iptables rule; needs iptables); --delay-mechanism netem|nfqueue chooses one. Workers are
    spread evenly (host i gets a contiguous block of ranks) and get PSGD_ADDR set to their host's
    address. The namespaces and delayers are removed on every exit: normal end, failure, --timeout,
    SIGINT, SIGTERM, and (by a watchdog process) also when the launcher itself is killed.

ENVIRONMENT GIVEN TO EACH WORKER
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE   its place in the job
  PSGD_STORE_ADDR, PSGD_STORE_PORT                 the launcher's store (a free port picked per job)
  MASTER_ADDR, MASTER_PORT                         torch.distributed's env:// rendezvous: rank 0's host and
                                                   a port free for its TCPStore (29500 when emulated)
  PSGD_TOKEN                                       random job token the store requires
  PSGD_STORE_HOSTED=1                              the store runs in the launcher
  PSGD_RUN_ID                                      random id of this job
  PSGD_ADDR                                        emulated cluster only: the host's address
  Local and emulated workers inherit the launcher's whole environment; ssh workers get the variables
  above plus every PSGD_* variable set in the launcher's environment. --env K=V adds or overrides a
  variable for every worker. `powersgd-run --print-env` lists every PSGD_* setting.

OUTPUT
  Each worker's stdout lines are printed to stdout prefixed "[RANK] ", its stderr lines likewise to
  stderr. With --log-dir DIR, DIR/rank-R.out and DIR/rank-R.err also receive them unprefixed.

FAILURE AND SIGNALS
  When a worker exits non-zero or is killed by a signal, the others get SIGTERM, then SIGKILL after
  --grace seconds; the launcher prints which rank failed, how, and its last lines of output.
  SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to every worker (same grace rules; a second
  one sends SIGKILL at once). Each local worker runs in its own process group (signals go to the whole
  group) and is killed (PR_SET_PDEATHSIG) when the launcher dies, even by SIGKILL; a watchdog process
  then also kills what is left of the worker process groups.

EXIT STATUS
  0         every worker exited 0
  N         the first worker to fail exited with N (128+S when it was killed by signal S)
  124       the job ran past --timeout
  128+S     the launcher got signal S (130 SIGINT, 143 SIGTERM, 129 SIGHUP) and stopped the job
  2         bad command line or unusable setup; nothing was started
  1         the launcher failed while starting the job (e.g. namespace setup), or a link delayer
            died during the job
)";

constexpr int kMaxSlots = std::numeric_limits<int>::max();

int parse_positive_int(const std::string& text, const std::string& what) {
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range && end == text.data() + text.size() && text.front() != '-')
    PSGD_THROW(InvalidArgumentError, what, " '", text, "' is out of range: expected 1 to ", kMaxSlots);
  if (ec != std::errc() || end != text.data() + text.size() || value < 1)
    PSGD_THROW(InvalidArgumentError, what, " '", text, "' is not a positive integer");
  return value;
}

// `where` names the entry (for the error message).
void add_host(std::vector<Host>& hosts, Host host, const std::string& where) {
  // The same host named twice is one host with the slots of both (as mpirun does).
  for (auto& h : hosts)
    if (h.name == host.name) {
      const int64_t sum = int64_t{h.slots} + host.slots;  // each is an int, their sum may not be
      if (sum > kMaxSlots)
        PSGD_THROW(InvalidArgumentError, where, ": host '", host.name, "' named again, its slots ", h.slots, " + ",
                   host.slots, " = ", sum, " are out of range: expected at most ", kMaxSlots, " slots per host");
      h.slots = static_cast<int>(sum);
      return;
    }
  hosts.push_back(std::move(host));
}

std::chrono::milliseconds seconds_option(double seconds, const char* name, bool allow_zero) {
  // The upper bound is poll(2)'s: an int of milliseconds (about 24.8 days).
  constexpr double kMaxSeconds = static_cast<double>(kMaxWait.count() / 1000);
  if (!std::isfinite(seconds) || seconds < 0 || (!allow_zero && seconds == 0) || seconds > kMaxSeconds)
    PSGD_THROW(InvalidArgumentError, name, " ", seconds, " is out of range: expected ",
               allow_zero ? "0 (none) or " : "", "a positive number of seconds, at most ",
               static_cast<int64_t>(kMaxSeconds));
  const int64_t ms = std::llround(seconds * 1000.0);
  // A positive value that rounds to 0 ms would mean none (a timeout) or no grace at all.
  if (seconds > 0 && ms == 0)
    PSGD_THROW(InvalidArgumentError, name, " ", seconds, " is below the resolution of 1 ms: expected ",
               allow_zero ? "0 (none) or " : "", "at least 0.001 seconds");
  return std::chrono::milliseconds(ms);
}

std::vector<std::string> split_blanks(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string word; in >> word;) words.push_back(word);
  return words;
}

void print_env_table() {
  std::printf("| Variable | Default | Description |\n| --- | --- | --- |\n");
  for (const auto& v : env::variables())
    std::printf("| `%.*s` | %s%.*s%s | %.*s |\n", static_cast<int>(v.name.size()), v.name.data(),
                v.default_value.empty() ? "" : "`", static_cast<int>(v.default_value.size()), v.default_value.data(),
                v.default_value.empty() ? "" : "`", static_cast<int>(v.description.size()), v.description.data());
}

}  // namespace

std::vector<Host> parse_host_list(const std::string& list) {
  std::vector<Host> hosts;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty())
      PSGD_THROW(InvalidArgumentError, "--hosts '", list, "' has an empty entry: expected host[:slots],...");
    Host host;
    std::string slots;
    if (item.front() == '[') {  // [IPv6]:slots
      auto close = item.find(']');
      if (close == std::string::npos)
        PSGD_THROW(InvalidArgumentError, "--hosts entry '", item, "' lacks the closing ']'");
      host.name = item.substr(1, close - 1);
      if (close + 1 < item.size()) {
        if (item[close + 1] != ':')
          PSGD_THROW(InvalidArgumentError, "--hosts entry '", item, "': expected [address]:slots");
        slots = item.substr(close + 2);
      }
    } else {
      auto colon = item.rfind(':');
      host.name = item.substr(0, colon);
      if (colon != std::string::npos) slots = item.substr(colon + 1);
    }
    if (host.name.empty()) PSGD_THROW(InvalidArgumentError, "--hosts entry '", item, "' has no host name");
    validate_host_name(host.name, detail::concat("--hosts entry '", item, "'"));
    if (!slots.empty() || item.back() == ':')
      host.slots = parse_positive_int(slots, detail::concat("--hosts entry '", item, "': slot count"));
    add_host(hosts, std::move(host), detail::concat("--hosts entry '", item, "'"));
  }
  if (hosts.empty()) PSGD_THROW(InvalidArgumentError, "--hosts is empty: expected host[:slots],...");
  return hosts;
}

std::vector<Host> parse_hostfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) PSGD_THROW_ERRNO(InvalidArgumentError, errno, "cannot read hostfile '", path, "'");
  std::vector<Host> hosts;
  int64_t number = 0;  // a line count of a file of any size: no int to overflow
  for (std::string line; std::getline(in, line);) {
    ++number;
    line = line.substr(0, line.find('#'));
    auto words = split_blanks(line);
    if (words.empty()) continue;
    std::string where = detail::concat("hostfile ", path, " line ", number);
    if (words.size() > 2) PSGD_THROW(InvalidArgumentError, where, ": '", line, "': expected 'host [slots]'");
    Host host{words[0], 1};
    validate_host_name(host.name, where);
    if (words.size() == 2) {
      std::string slots = words[1];
      if (slots.rfind("slots=", 0) == 0) slots = slots.substr(6);
      host.slots = parse_positive_int(slots, detail::concat(where, ": slot count"));
    }
    add_host(hosts, std::move(host), where);
  }
  if (in.bad()) PSGD_THROW_ERRNO(InvalidArgumentError, errno, "cannot read hostfile '", path, "'");
  if (hosts.empty()) PSGD_THROW(InvalidArgumentError, "hostfile '", path, "' names no host");
  return hosts;
}

uint64_t parse_rate(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  std::string unit = text.substr(digits);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  double scale = 0;
  if (unit == "bit" || unit.empty()) scale = 1;
  else if (unit == "kbit") scale = 1e3;
  else if (unit == "mbit") scale = 1e6;
  else if (unit == "gbit") scale = 1e9;
  else if (unit == "tbit") scale = 1e12;
  double number = 0;
  std::string number_text = text.substr(0, digits);
  auto [end, ec] = std::from_chars(number_text.data(), number_text.data() + number_text.size(), number);
  if (scale == 0 || number_text.empty() || ec != std::errc() || end != number_text.data() + number_text.size())
    PSGD_THROW(InvalidArgumentError, "--link-rate '", text,
               "' is not a rate: expected a number with unit bit, kbit, mbit, gbit or tbit, e.g. 1gbit");
  double bits = number * scale;
  // tbf cannot shape below a few kbit/s usefully; above 32tbit its burst (a millisecond of the rate, in bytes:
  // netns.cpp) passes the u32 tc holds it in (from 34.36tbit), which failed at setup instead of here.
  if (bits < 8000 || bits > 32e12)
    PSGD_THROW(InvalidArgumentError, "--link-rate '", text, "' is out of range: expected 8kbit to 32tbit");
  return static_cast<uint64_t>(bits);
}

std::chrono::nanoseconds parse_delay(const std::string& text, const std::string& what) {
  size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  const std::string number_text = text.substr(0, digits), unit = text.substr(digits);
  double number = 0;
  auto [end, ec] = std::from_chars(number_text.data(), number_text.data() + number_text.size(), number);
  const bool parsed = !number_text.empty() && ec == std::errc() && end == number_text.data() + number_text.size();
  double scale = 0;  // nanoseconds per unit
  if (unit == "ns") scale = 1;
  else if (unit == "us") scale = 1e3;
  else if (unit == "ms") scale = 1e6;
  else if (unit == "s") scale = 1e9;
  else if (unit.empty() && parsed && number == 0) scale = 1;  // "0" needs no unit
  if (!text.empty() && text.front() == '-')
    PSGD_THROW(InvalidArgumentError, what, " '", text, "' is negative: expected a one-way delay of 0 or more, e.g. 5ms");
  if (!parsed || scale == 0)
    PSGD_THROW(InvalidArgumentError, what, " '", text,
               "' is not a delay: expected a number with unit ns, us, ms or s (e.g. 5ms, 250us), or 0");
  const double ns = number * scale;
  if (ns > static_cast<double>(std::chrono::nanoseconds(kMaxDelay).count()))
    PSGD_THROW(InvalidArgumentError, what, " '", text, "' is out of range: expected 0 to ", kMaxDelay.count(),
               "s one way");
  if (ns > 0 && std::llround(ns) == 0)  // would be no delay at all, silently
    PSGD_THROW(InvalidArgumentError, what, " '", text, "' is below the resolution of 1ns: expected 0 or at least 1ns");
  return std::chrono::nanoseconds(std::llround(ns));
}

std::string delay_text(std::chrono::nanoseconds delay) {
  const auto ns = static_cast<double>(delay.count());
  char buffer[48];
  if (delay.count() == 0) return "0";
  if (ns >= 1e9) std::snprintf(buffer, sizeof buffer, "%g s", ns / 1e9);
  else if (ns >= 1e6) std::snprintf(buffer, sizeof buffer, "%g ms", ns / 1e6);
  else if (ns >= 1e3) std::snprintf(buffer, sizeof buffer, "%g us", ns / 1e3);
  else std::snprintf(buffer, sizeof buffer, "%g ns", ns);
  return buffer;
}

std::string resolve_program(const std::string& program) {
  auto check = [&](const std::string& path) -> int {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) return ENOENT;
    if (!S_ISREG(st.st_mode)) return EISDIR;
    if (access(path.c_str(), X_OK) != 0) return EACCES;
    return 0;
  };
  if (program.empty()) PSGD_THROW(InvalidArgumentError, "the program to run is empty");
  if (program.find('/') != std::string::npos) {
    int err = check(program);
    if (err == ENOENT) PSGD_THROW(InvalidArgumentError, "program '", program, "' does not exist");
    if (err != 0) PSGD_THROW(InvalidArgumentError, "program '", program, "' is not an executable file");
    // Absolute, but links left as they are: a venv's bin/python is a link to the system's interpreter and
    // finds its venv only when started through the link.
    std::error_code error;
    const std::filesystem::path path = std::filesystem::absolute(program, error);
    if (error) PSGD_THROW(InvalidArgumentError, "program '", program, "': ", error.message());
    return path.string();
  }
  const char* path_env = std::getenv("PATH");
  std::stringstream dirs(path_env != nullptr ? path_env : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (check(candidate) == 0) return candidate;
  }
  PSGD_THROW(InvalidArgumentError, "program '", program, "' was not found in PATH, or is not executable there");
}

// More workers than any job this launcher starts: a larger -n or slot total is a
// typo (e.g. host:333333333) that would otherwise exhaust memory placing ranks.
constexpr int kMaxWorkers = 65536;

std::vector<Placement> place_ranks(const Options& options) {
  std::vector<Placement> placements;
  auto add_block = [&](int host, int count) {
    for (int i = 0; i < count; ++i)
      placements.push_back({static_cast<int>(placements.size()), host, i, count});
  };
  switch (options.mode) {
    case Mode::Local:
      add_block(0, options.nproc);
      break;
    case Mode::Emulated:
      // Contiguous blocks whose sizes differ by at most one.
      for (int h = 0; h < options.emulate_hosts; ++h) {
        int64_t begin = int64_t{options.nproc} * h / options.emulate_hosts;
        int64_t end = int64_t{options.nproc} * (h + 1) / options.emulate_hosts;
        add_block(h, static_cast<int>(end - begin));
      }
      break;
    case Mode::Ssh: {
      // Fill hosts in order up to -n (all slots when -n is not given).
      int left = options.nproc;
      for (size_t h = 0; h < options.hosts.size() && left > 0; ++h) {
        int count = std::min(left, options.hosts[h].slots);
        add_block(static_cast<int>(h), count);
        left -= count;
      }
      break;
    }
  }
  return placements;
}

ParseResult parse_command_line(int argc, char** argv) {
  CLI::App app(kDescription, "powersgd-run");
  app.footer(kFooter);
  app.get_formatter()->column_width(34);
  app.allow_extras();

  Options o;
  std::string hosts, hostfile, ssh_command, link_rate, link_delay, delay_mechanism;
  double grace = 5, timeout = 0;
  std::vector<std::string> env_items;
  bool print_env = false, version = false;

  app.add_option("-n,--nproc", o.nproc, "Number of workers (local and emulated: required; multi-node: at most "
                                         "the slots, default all slots)");
  auto* hosts_opt = app.add_option("--hosts", hosts, "Multi-node: comma-separated host[:slots] list")->type_name("LIST");
  auto* hostfile_opt = app.add_option("--hostfile", hostfile, "Multi-node: file of 'host [slots]' lines")
                           ->type_name("FILE");
  hosts_opt->excludes(hostfile_opt);
  app.add_option("--ssh", ssh_command, "ssh command (split on blanks; default: ssh)")->type_name("CMD");
  app.add_option("--ssh-port", o.ssh.port, "Port of the remote sshd")->check(CLI::Range(1, 65535));
  app.add_option("--ssh-user", o.ssh.user, "Remote user name");
  app.add_option("--ssh-option", o.ssh.options, "Passed to ssh as -o OPTION (repeatable)")
      ->type_name("OPTION")
      ->allow_extra_args(false);  // one value per occurrence, so "--" and the program stay apart
  app.add_option("--master-addr", o.master_addr, "Multi-node: address of this machine that workers use to reach "
                                                 "the store");
  auto* emulate_opt = app.add_option("--emulate-hosts", o.emulate_hosts, "Emulated cluster of N network namespaces")
                          ->check(CLI::Range(1, 250))
                          ->type_name("N");
  app.add_option("--link-rate", link_rate, "Emulated cluster: each host's link rate, e.g. 1gbit")
      ->type_name("RATE")
      ->needs(emulate_opt);
  auto* delay_opt = app.add_option("--link-delay", link_delay,
                 "Emulated cluster: one-way delay added to the traffic into each host, e.g. 5ms, 250us")
      ->type_name("DELAY")
      ->needs(emulate_opt);
  app.add_option("--delay-mechanism", delay_mechanism,
                 "How --link-delay is applied: auto (netem where the kernel has it, else the NFQUEUE delayer), "
                 "netem or nfqueue")
      ->type_name("auto|netem|nfqueue")
      ->check(CLI::IsMember({"auto", "netem", "nfqueue"}))
      ->needs(delay_opt);
  emulate_opt->excludes(hosts_opt)->excludes(hostfile_opt);
  app.add_option("--env", env_items, "Set K=V in every worker's environment (repeatable)")
      ->type_name("K=V")
      ->allow_extra_args(false);
  app.add_option("--log-dir", o.log_dir, "Also write DIR/rank-R.out and DIR/rank-R.err (DIR is created)")->type_name("DIR");
  app.add_option("--grace", grace, "Seconds between SIGTERM and SIGKILL when stopping workers (default 5)")
      ->type_name("SECONDS");
  app.add_option("--timeout", timeout, "Stop the job after SECONDS, exit 124 (default: none)")->type_name("SECONDS");
  app.add_flag("--print-env", print_env, "Print the table of environment variables powersgd reads, and exit");
  app.add_flag("--version", version, "Print the version and exit");
  app.add_option("command", o.command, "PROGRAM ARGS... (after --)")->type_name("PROGRAM ARGS...");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return {std::nullopt, app.exit(e)};
  } catch (const CLI::ParseError& e) {
    std::cerr << "powersgd-run: error: " << e.what() << "\nRun with --help for more information.\n";
    return {std::nullopt, 2};
  }
  // Extras are collected rather than rejected by CLI11 so the message can name them.
  // (CLI11 also reports the "--" separator itself as an extra.)
  auto extras = app.remaining();
  bool separated = std::erase(extras, std::string("--")) > 0;
  if (!extras.empty()) {
    const std::string first = extras.front();
    std::cerr << "powersgd-run: error: " << (first.rfind('-', 0) == 0 ? "unknown option '" : "unexpected argument '")
              << first << "'"
              << (o.command.empty() || separated ? "" : " (options of the program go after '--': powersgd-run [options] -- PROGRAM ARGS...)")
              << "\nRun with --help for more information.\n";
    return {std::nullopt, 2};
  }
  if (print_env) {
    print_env_table();
    return {std::nullopt, 0};
  }
  if (version) {
    std::printf("powersgd-run %s\n", PSGD_VERSION);
    return {std::nullopt, 0};
  }

  try {
    if (o.command.empty())
      PSGD_THROW(InvalidArgumentError, "no program given: expected powersgd-run [options] -- PROGRAM ARGS...");
    // CLI11 reads an empty value as zero or as not given: --timeout "$T" with T unset would mean no timeout.
    for (const CLI::Option* option : app.get_options())
      if (option->get_name() != "command" && option->get_type_size() != 0)
        for (const std::string& value : option->results())
          if (value.empty())
            PSGD_THROW(InvalidArgumentError, option->get_name(), " '': expected a value");
    if (app.count("-n") > 0 && (o.nproc < 1 || o.nproc > kMaxWorkers))
      PSGD_THROW(InvalidArgumentError, "-n ", o.nproc, " is out of range: expected 1 to ", kMaxWorkers, " workers");
    o.grace = seconds_option(grace, "--grace", true);
    o.timeout = seconds_option(timeout, "--timeout", true);
    for (const auto& item : env_items) {
      auto eq = item.find('=');
      std::string name = item.substr(0, eq);
      if (eq == std::string::npos || !is_shell_identifier(name))
        PSGD_THROW(InvalidArgumentError, "--env '", item,
                   "': expected NAME=VALUE with NAME made of letters, digits and '_'");
      o.env.emplace_back(name, item.substr(eq + 1));
    }
    if (!o.log_dir.empty()) {
      std::error_code error;
      std::filesystem::create_directories(o.log_dir, error);  // like mkdir -p; an existing one is fine
      if (error || access(o.log_dir.c_str(), W_OK) != 0)
        PSGD_THROW(InvalidArgumentError, "--log-dir '", o.log_dir, "' is not a writable directory",
                   error ? ": " + error.message() : std::string());
    }

    bool multi_node = !hosts.empty() || !hostfile.empty() || app.count("--hosts") > 0 || app.count("--hostfile") > 0;
    if (multi_node) {
      o.mode = Mode::Ssh;
      o.hosts = !hostfile.empty() || app.count("--hostfile") > 0 ? parse_hostfile(hostfile) : parse_host_list(hosts);
      int64_t slots = 0;  // int64: each host's count is an int, their sum may not be
      for (const auto& h : o.hosts) slots += h.slots;
      if (o.nproc == 0) {
        if (slots > kMaxWorkers)
          PSGD_THROW(InvalidArgumentError, "the hosts given have ", slots, " slots: without -n that many workers, ",
                     "more than ", kMaxWorkers, "; give -n or smaller slot counts");
        o.nproc = static_cast<int>(slots);
      }
      if (o.nproc > slots)
        PSGD_THROW(InvalidArgumentError, "-n ", o.nproc, " is more than the ", slots, " slots of the hosts given");
      if (!ssh_command.empty()) o.ssh.command = split_blanks(ssh_command);
      if (o.ssh.command.empty()) PSGD_THROW(InvalidArgumentError, "--ssh is empty: expected an ssh command");
    } else {
      for (const char* name : {"--ssh", "--ssh-port", "--ssh-user", "--ssh-option", "--master-addr"})
        if (app.count(name) > 0) PSGD_THROW(InvalidArgumentError, name, " needs --hosts or --hostfile");
      if (o.nproc == 0)
        PSGD_THROW(InvalidArgumentError, "-n is required: expected the number of workers, e.g. -n 4");
      if (app.count("--emulate-hosts") > 0) {
        o.mode = Mode::Emulated;
        if (o.nproc < o.emulate_hosts)
          PSGD_THROW(InvalidArgumentError, "-n ", o.nproc, " is less than --emulate-hosts ", o.emulate_hosts,
                     ": expected at least one worker per emulated host");
        if (!link_rate.empty()) o.link_rate_bits = parse_rate(link_rate);
        if (app.count("--link-delay") > 0) o.link_delay = parse_delay(link_delay, "--link-delay");
        if (delay_mechanism == "netem") o.delay_mechanism = DelayMechanism::Netem;
        if (delay_mechanism == "nfqueue") o.delay_mechanism = DelayMechanism::Nfqueue;
      }
    }
    if (o.mode != Mode::Ssh) o.command[0] = resolve_program(o.command[0]);
  } catch (const InvalidArgumentError& e) {
    std::cerr << "powersgd-run: error: " << e.what() << "\n";
    return {std::nullopt, 2};
  }
  return {std::move(o), 0};
}

}  // namespace powersgd::run
