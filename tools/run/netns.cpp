#include "netns.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "common/check.hpp"

namespace powersgd::run {

std::string emulation_privilege_problem() {
  std::ifstream status("/proc/self/status");
  uint64_t effective = 0;
  for (std::string line; std::getline(status, line);)
    if (line.rfind("CapEff:", 0) == 0) effective = std::stoull(line.substr(7), nullptr, 16);
  constexpr int kNetAdmin = 12, kSysAdmin = 21;
  std::string missing;
  if ((effective & (uint64_t{1} << kNetAdmin)) == 0) missing += " CAP_NET_ADMIN";
  if ((effective & (uint64_t{1} << kSysAdmin)) == 0) missing += " CAP_SYS_ADMIN";
  if (missing.empty()) return {};
  return detail::concat("--emulate-hosts needs root: creating network namespaces, a bridge and tbf shapers takes "
                        "CAP_NET_ADMIN and CAP_SYS_ADMIN, and this process lacks", missing,
                        " (run powersgd-run as root, e.g. with sudo)");
}

std::string look_up_tool(const std::string& name) {
  std::string dirs = "/usr/sbin:/sbin:/usr/bin:/bin";
  if (const char* path = std::getenv("PATH")) dirs = std::string(path) + ":" + dirs;
  std::stringstream in(dirs);
  for (std::string dir; std::getline(in, dir, ':');) {
    std::string candidate = dir + "/" + name;
    if (!dir.empty() && access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return {};
}

std::string find_tool(const std::string& name) {
  std::string path = look_up_tool(name);
  if (path.empty()) PSGD_THROW(UnsupportedError, "--emulate-hosts needs iproute2's '", name, "', which is not installed");
  return path;
}

std::string EmulatedCluster::host_address(int host) { return detail::concat("10.77.0.", host + 1); }
std::string EmulatedCluster::bridge_address() { return "10.77.0.254"; }

void EmulatedCluster::run_tool(const std::string& tool, const std::vector<std::string>& args, int netns_fd) {
  std::vector<std::string> argv{tool};
  argv.insert(argv.end(), args.begin(), args.end());
  auto result = run_command(argv, netns_fd);
  if (result.code != 0) {
    std::string line;
    for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
    PSGD_THROW(IoError, "emulated cluster setup: '", line, "' failed with exit code ", result.code, ": ",
               result.output);
  }
}

void EmulatedCluster::add_namespace(const std::string& name,
                                    const std::function<void(const std::string&)>& before_create) {
  before_create(name);
  ip({"netns", "add", name});
  names_.push_back(name);
}

EmulatedCluster::EmulatedCluster(int hosts, const LinkOptions& links,
                                 const std::function<void(const std::string&)>& before_create,
                                 const GroupHooks& delayer_hooks) {
  ip_ = find_tool("ip");
  tc_ = find_tool("tc");
  std::string prefix = detail::concat("psgd-", ::getpid(), "-");
  std::string br = prefix + "br";
  auto open_ns = [](const std::string& name) {
    std::string path = "/run/netns/" + name;
    return Fd(PSGD_CHECK_SYS_MSG(::open(path.c_str(), O_RDONLY | O_CLOEXEC), IoError, "cannot open ", path));
  };
  // tbf reaches its rate only with a bucket of at least ~1 ms of traffic and
  // 128 KiB (shared/notes/cluster-emulation.md); latency bounds its queue.
  uint64_t burst = std::max<uint64_t>(128 * 1024, links.rate_bits / 8 / 1000);
  auto shape = [&](const std::string& ns, const std::string& dev, const std::vector<std::string>& where) {
    std::vector<std::string> args{"-n", ns, "qdisc", "add", "dev", dev};
    args.insert(args.end(), where.begin(), where.end());
    args.insert(args.end(), {"tbf", "rate", detail::concat(links.rate_bits, "bit"), "burst", detail::concat(burst),
                             "latency", "50ms"});
    tc(args);
  };
  // The delay is netem's on each bridge port (the traffic into the host) where the kernel has it: the first
  // port tries it, and its failure (no sch_netem, as on the machines of cluster-emulation.md) chooses the
  // NFQUEUE delayer for every host. netem holds up to ~10 s of 1 Gbit/s traffic; tbf is its child, so the
  // rate applies to what leaves the delay.
  const bool delayed = links.delay.count() > 0;
  bool netem = false, nfqueue = delayed && links.mechanism == DelayMechanism::Nfqueue;
  std::string netem_problem = nfqueue ? "not tried (--delay-mechanism nfqueue)" : "";
  const std::string netem_delay = detail::concat(std::max<int64_t>(1, (links.delay.count() + 500) / 1000), "us");
  try {
    add_namespace(br, before_create);
    bridge_fd_ = open_ns(br);
    ip({"-n", br, "link", "set", "lo", "up"});
    ip({"-n", br, "link", "add", "br0", "type", "bridge"});
    ip({"-n", br, "addr", "add", bridge_address() + "/24", "dev", "br0"});
    ip({"-n", br, "link", "set", "br0", "up"});
    for (int h = 0; h < hosts; ++h) {
      std::string ns = detail::concat(prefix, "h", h);
      std::string port = detail::concat("h", h);
      add_namespace(ns, before_create);
      host_fds_.push_back(open_ns(ns));
      ip({"-n", ns, "link", "set", "lo", "up"});
      ip({"-n", ns, "link", "add", kInterface, "type", "veth", "peer", "name", port, "netns", br});
      ip({"-n", ns, "addr", "add", host_address(h) + "/24", "dev", kInterface});
      ip({"-n", ns, "link", "set", kInterface, "up"});
      ip({"-n", br, "link", "set", port, "master", "br0"});
      ip({"-n", br, "link", "set", port, "up"});
      if (delayed && !nfqueue) {
        std::vector<std::string> argv{tc_, "-n", br, "qdisc", "add", "dev", port, "root", "handle", "1:",
                                      "netem", "delay", netem_delay, "limit", "1000000"};
        auto result = run_command(argv);
        if (result.code == 0) {
          netem = true;
        } else if (netem || links.mechanism == DelayMechanism::Netem) {
          std::string line;
          for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
          PSGD_THROW(UnsupportedError, "--link-delay with netem: '", line, "' failed with exit code ", result.code,
                     ": ", result.output);
        } else {
          nfqueue = true;
          netem_problem = result.output;
          while (!netem_problem.empty() && netem_problem.back() == '\n') netem_problem.pop_back();
        }
      }
      if (links.rate_bits > 0) {
        shape(ns, kInterface, {"root"});                                         // host -> bridge
        shape(br, port, netem ? std::vector<std::string>{"parent", "1:1", "handle", "10:"}
                              : std::vector<std::string>{"root"});             // bridge -> host
      }
    }
    if (netem) delay_method_ = "netem on each host's bridge port";
    if (nfqueue) start_delayers(links.delay, netem_problem, delayer_hooks);
  } catch (...) {
    remove();
    throw;
  }
}

void EmulatedCluster::start_delayers(std::chrono::nanoseconds delay, const std::string& netem_problem,
                                     const GroupHooks& hooks) {
  const std::string program = find_delayer(), iptables = look_up_tool("iptables");
  if (program.empty() || iptables.empty()) {
    std::string missing = program.empty() ? delayer_problem() : "";
    if (iptables.empty())
      missing += detail::concat(missing.empty() ? "" : "; ", "iptables is not installed (Debian package iptables)");
    PSGD_THROW(UnsupportedError, "--link-delay ", delay_text(delay),
               " needs netem or the NFQUEUE delayer, and neither is available here: netem: ", netem_problem,
               "; NFQUEUE: ", missing);
  }
  for (int h = 0; h < hosts(); ++h) {
    const std::string& ns = names_.at(static_cast<size_t>(h) + 1);
    delayers_.start(program, ns, host_netns_fd(h), delay, hooks);
    // Inbound (PREROUTING): held packets then cost the receiver nothing, where
    // holding them on the way out holds the sender's socket memory and TCP's
    // small queues throttle it (cluster-emulation.md). --queue-bypass: a
    // queue without its delayer passes packets, never drops them. -w: the
    // legacy backend's lock may be held by another iptables user (wait for it).
    run_tool(iptables, {"-w", "-t", "raw", "-A", "PREROUTING", "-i", kInterface, "-j", "NFQUEUE", "--queue-num", "0",
                        "--queue-bypass"},
             host_netns_fd(h));
  }
  delay_method_ = detail::concat("powersgd-delay (NFQUEUE) in each host's namespace; netem: ", netem_problem);
}

int kill_namespace_members(const std::string& name) noexcept {
  struct stat target {};
  if (::stat(("/run/netns/" + name).c_str(), &target) != 0) return 0;
  const pid_t self = ::getpid();
  std::vector<pid_t> killed;  // a killed process may still be listed (dying, a zombie) in the next pass
  for (int pass = 0; pass < 3; ++pass) {
    DIR* proc = ::opendir("/proc");
    if (proc == nullptr) break;
    bool found = false;
    while (const dirent* entry = ::readdir(proc)) {
      char* end = nullptr;
      const long number = std::strtol(entry->d_name, &end, 10);
      const auto pid = static_cast<pid_t>(number);
      if (end == entry->d_name || *end != '\0' || number <= 0 || pid == self ||
          std::find(killed.begin(), killed.end(), pid) != killed.end())
        continue;
      struct stat ns {};
      if (::stat(detail::concat("/proc/", pid, "/ns/net").c_str(), &ns) != 0) continue;  // gone, or a kernel thread
      if (ns.st_dev == target.st_dev && ns.st_ino == target.st_ino && ::kill(pid, SIGKILL) == 0) {
        killed.push_back(pid);
        found = true;
      }
    }
    ::closedir(proc);
    if (!found) break;
  }
  return static_cast<int>(killed.size());
}

void EmulatedCluster::remove() noexcept {
  // A delayer keeps its namespace alive: they go first. Their iptables rules go with the namespaces.
  delayers_.stop();
  host_fds_.clear();
  bridge_fd_.reset();
  // Hosts first: deleting a host namespace also deletes its veth pair.
  for (auto it = names_.rbegin(); it != names_.rend(); ++it) {
    if (const int left = kill_namespace_members(*it); left > 0)
      std::fprintf(stderr, "powersgd-run: killed %d process(es) still in network namespace %s (descendants of a "
                   "worker that left its process group)\n", left, it->c_str());
    try {
      auto result = run_command({ip_, "netns", "delete", *it});
      if (result.code != 0)
        std::fprintf(stderr, "powersgd-run: warning: cannot delete network namespace %s: %s", it->c_str(),
                     result.output.c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "powersgd-run: warning: cannot delete network namespace %s: %s\n", it->c_str(), e.what());
    }
  }
  names_.clear();
}

}  // namespace powersgd::run
