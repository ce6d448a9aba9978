// The emulated cluster: one network namespace per emulated host, joined by a
// Linux bridge that lives in a namespace of its own, each host's link shaped
// with tbf. Built with iproute2's `ip` and `tc`; needs CAP_NET_ADMIN and
// CAP_SYS_ADMIN (ip netns mounts under /run/netns). Design: docs/launcher.md.
//
// Layout (P = launcher pid):
//   psgd-P-h<i>: eth0 = 10.77.0.<i+1>/24 (+ lo), tbf on eth0 egress
//   psgd-P-br:   br0  = 10.77.0.254/24, ports h<i> (the peers of each eth0), tbf on each h<i> egress
// Nothing is created in the launcher's own namespace, so the addresses exist
// only inside these namespaces and other jobs' clusters do not collide.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "process.hpp"

namespace powersgd::run {

// Empty when this process may create namespaces, else a message saying what is missing.
std::string emulation_privilege_problem();

// Path of an iproute2 tool ("ip", "tc"): PATH, then /usr/sbin and /sbin. Throws UnsupportedError.
std::string find_tool(const std::string& name);

class EmulatedCluster {
 public:
  // Creates the namespaces and links; on failure removes what it created and
  // throws IoError with the failing command and its output. rate_bits 0: unshaped.
  // before_create(name) runs before each namespace is created (the watchdog's hook).
  EmulatedCluster(int hosts, uint64_t rate_bits, const std::function<void(const std::string&)>& before_create);
  ~EmulatedCluster() { remove(); }
  EmulatedCluster(const EmulatedCluster&) = delete;
  EmulatedCluster& operator=(const EmulatedCluster&) = delete;

  // Deletes every namespace this object created (idempotent, never throws;
  // problems are printed to stderr). Call after the workers are gone.
  void remove() noexcept;

  int hosts() const { return static_cast<int>(host_fds_.size()); }
  int host_netns_fd(int host) const { return host_fds_.at(static_cast<size_t>(host)).get(); }
  int bridge_netns_fd() const { return bridge_fd_.get(); }
  static std::string host_address(int host);
  static std::string bridge_address();
  static constexpr const char* kInterface = "eth0";
  // Names of the namespaces created so far, bridge first.
  const std::vector<std::string>& names() const { return names_; }
  const std::string& ip_tool() const { return ip_; }

 private:
  static void run_tool(const std::string& tool, const std::vector<std::string>& args);  // throws IoError
  void ip(const std::vector<std::string>& args) { run_tool(ip_, args); }
  void tc(const std::vector<std::string>& args) { run_tool(tc_, args); }
  void add_namespace(const std::string& name, const std::function<void(const std::string&)>& before_create);

  std::string ip_, tc_;
  std::vector<std::string> names_;
  Fd bridge_fd_;
  std::vector<Fd> host_fds_;
};

}  // namespace powersgd::run
