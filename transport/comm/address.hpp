// Choice of the local address the TCP transport binds to. Private to transport.
#pragma once

#include <string>

namespace powersgd::transport {

// True when `host` is "localhost" or resolves only to loopback addresses.
bool is_loopback(const std::string& host);

// The local address this host uses to reach `host`: "127.0.0.1" when `host` is
// loopback, else the source address the kernel picks for a UDP socket
// connected to it (connect on UDP sends nothing). Blocking (name resolution).
// Throws IoError naming the host and the PSGD_IFACE / PSGD_ADDR fix.
std::string local_address_towards(const std::string& host);

}  // namespace powersgd::transport
