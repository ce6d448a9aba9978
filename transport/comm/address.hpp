// Which local address reaches a host, and whether a host is this machine's
// loopback. The one copy: the communicator (binding its store and the TCP
// transport) and the launcher (binding its store, choosing MASTER_ADDR) use it.
// Private to powersgd.
#pragma once

#include <string>

namespace powersgd::transport {

// How errors name the host: `role` says what it is ("MASTER_ADDR", "host"),
// `fix` what the user can do about it (appended in parentheses when not empty).
struct HostRole {
  const char* role;
  const char* fix = "";
};

// The store's host as the communicator knows it (CommOptions::store_addr).
inline constexpr HostRole kMasterAddr{"MASTER_ADDR", "set PSGD_ADDR or PSGD_IFACE to choose the local address explicitly"};

// True when `host` is "localhost" or every address it resolves to is a
// loopback address (127.0.0.0/8, ::1, or ::ffff:127.0.0.0/104). Blocking (name
// resolution only: nothing is sent). Throws IoError "<role> '<host>' does not
// resolve: ..." when it does not resolve.
bool is_loopback(const std::string& host, const HostRole& role);

// The local address this host uses to reach `host`: "127.0.0.1" when `host` is
// loopback, else the source address the kernel picks for a UDP socket
// connected to one of its addresses (connect on UDP chooses a route and sends
// nothing). Blocking. Throws IoError naming the host, its role and the fix.
std::string local_address_towards(const std::string& host, const HostRole& role);

// Checks that `address` (PSGD_ADDR) resolves to something this host can bind
// (Gloo resolves and binds it itself, but crashes on an unresolvable one).
// Throws InvalidArgumentError naming PSGD_ADDR otherwise.
void require_bindable(const std::string& address);

}  // namespace powersgd::transport
