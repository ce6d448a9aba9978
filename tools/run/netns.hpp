// The emulated cluster: one network namespace per emulated host, joined by a
// Linux bridge that lives in a namespace of its own, each host's link shaped
// with tbf and delayed (netem, else the NFQUEUE delayer: link_delay.hpp).
// Built with iproute2's `ip` and `tc`; needs CAP_NET_ADMIN and CAP_SYS_ADMIN
// (ip netns mounts under /run/netns). Design: docs/launcher.md.
//
// Layout (P = launcher pid):
//   psgd-P-h<i>: eth0 = 10.77.0.<i+1>/24 (+ lo), tbf on eth0 egress;
//                with a delay and no netem: iptables raw PREROUTING -i eth0 -> NFQUEUE 0, powersgd-delay
//   psgd-P-br:   br0  = 10.77.0.254/24, ports h<i> (the peers of each eth0), on each h<i> egress
//                tbf, or netem (the delay) with tbf as its child
// Nothing is created in the launcher's own namespace, so the addresses exist
// only inside these namespaces and other jobs' clusters do not collide.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "link_delay.hpp"
#include "options.hpp"
#include "process.hpp"

namespace powersgd::run {

// Empty when this process may create namespaces, else a message saying what is missing.
std::string emulation_privilege_problem();

// Path of a system tool ("ip", "tc", "iptables"): PATH, then /usr/sbin and /sbin; empty when missing.
std::string look_up_tool(const std::string& name);
// The same for iproute2's tools, which the emulated cluster cannot do without. Throws UnsupportedError.
std::string find_tool(const std::string& name);

// SIGKILLs every process whose network namespace is the named one (`ip netns` name), this one excepted, and
// returns how many: a worker's descendant that left its process group (setsid) outlives the group's SIGKILL and
// would keep running in a namespace that no longer has a name. Scans /proc a few times, for processes forked
// meanwhile. Never throws.
int kill_namespace_members(const std::string& name) noexcept;

// What each host's link gets.
struct LinkOptions {
  uint64_t rate_bits = 0;                   // 0: unshaped
  std::chrono::nanoseconds delay{0};        // one way, on the traffic into each host; 0: none
  DelayMechanism mechanism = DelayMechanism::Auto;
};

class EmulatedCluster {
 public:
  // Creates the namespaces and links, and starts the link delayers when the
  // delay needs them; on failure removes what it created and throws IoError
  // with the failing command and its output (UnsupportedError when the delay
  // has no mechanism here). before_create(name) runs before each namespace is
  // created; `delayer_hooks` learn of each delayer's process group (the watchdog's hooks).
  EmulatedCluster(int hosts, const LinkOptions& links, const std::function<void(const std::string&)>& before_create,
                  const GroupHooks& delayer_hooks);
  ~EmulatedCluster() { remove(); }
  EmulatedCluster(const EmulatedCluster&) = delete;
  EmulatedCluster& operator=(const EmulatedCluster&) = delete;

  // Stops the delayers, then deletes every namespace this object created
  // (idempotent, never throws; problems are printed to stderr). Call after
  // the workers are gone.
  void remove() noexcept;

  // A message when a link delayer has died (LinkDelayers::check); empty otherwise.
  std::string check_delayers() { return delayers_.check(); }
  // How the delay is applied, for the launcher's one line about it; empty without a delay.
  const std::string& delay_method() const { return delay_method_; }

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
  // Throws IoError; netns_fd >= 0: runs inside that namespace.
  static void run_tool(const std::string& tool, const std::vector<std::string>& args, int netns_fd = -1);
  void ip(const std::vector<std::string>& args) { run_tool(ip_, args); }
  void tc(const std::vector<std::string>& args) { run_tool(tc_, args); }
  void add_namespace(const std::string& name, const std::function<void(const std::string&)>& before_create);
  void start_delayers(std::chrono::nanoseconds delay, const std::string& netem_problem, const GroupHooks& hooks);

  std::string ip_, tc_;
  std::vector<std::string> names_;
  Fd bridge_fd_;
  std::vector<Fd> host_fds_;
  LinkDelayers delayers_;
  std::string delay_method_;
};

}  // namespace powersgd::run
