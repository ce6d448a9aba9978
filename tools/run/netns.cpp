#include "netns.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
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

std::string find_tool(const std::string& name) {
  std::string dirs = "/usr/sbin:/sbin:/usr/bin:/bin";
  if (const char* path = std::getenv("PATH")) dirs = std::string(path) + ":" + dirs;
  std::stringstream in(dirs);
  for (std::string dir; std::getline(in, dir, ':');) {
    std::string candidate = dir + "/" + name;
    if (!dir.empty() && access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  PSGD_THROW(UnsupportedError, "--emulate-hosts needs iproute2's '", name, "', which is not installed");
}

std::string EmulatedCluster::host_address(int host) { return detail::concat("10.77.0.", host + 1); }
std::string EmulatedCluster::bridge_address() { return "10.77.0.254"; }

void EmulatedCluster::run_tool(const std::string& tool, const std::vector<std::string>& args) {
  std::vector<std::string> argv{tool};
  argv.insert(argv.end(), args.begin(), args.end());
  auto result = run_command(argv);
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

EmulatedCluster::EmulatedCluster(int hosts, uint64_t rate_bits,
                                 const std::function<void(const std::string&)>& before_create) {
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
  uint64_t burst = std::max<uint64_t>(128 * 1024, rate_bits / 8 / 1000);
  auto shape = [&](const std::string& ns, const std::string& dev) {
    tc({"-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", detail::concat(rate_bits, "bit"), "burst",
        detail::concat(burst), "latency", "50ms"});
  };
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
      if (rate_bits > 0) {
        shape(ns, kInterface);  // host -> bridge
        shape(br, port);        // bridge -> host
      }
    }
  } catch (...) {
    remove();
    throw;
  }
}

void EmulatedCluster::remove() noexcept {
  host_fds_.clear();
  bridge_fd_.reset();
  // Hosts first: deleting a host namespace also deletes its veth pair.
  for (auto it = names_.rbegin(); it != names_.rend(); ++it) {
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
