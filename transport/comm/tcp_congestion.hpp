// PSGD_TCP_CONGESTION: the TCP congestion control of this rank's connections to its peers, set per socket
// (TCP_CONGESTION) on the sockets Gloo opened, since Gloo owns them and offers no hook for socket options
// (docs/scaling.md, "TCP": at a distance cubic sends PowerSGD's short bursts faster than bbr). Private to
// transport.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

namespace powersgd::transport {

// PSGD_TCP_CONGESTION: empty (the default) leaves the host's (net.ipv4.tcp_congestion_control); a name is
// checked now on a socket of its own, so that a name this process cannot set (not available, or not in
// net.ipv4.tcp_allowed_congestion_control without CAP_NET_ADMIN) is an InvalidArgumentError at creation,
// naming the value and both lists, before any rank connects.
std::string tcp_congestion_from_env();

// The inodes of this process's open sockets (/proc/self/fd); empty where /proc is not readable.
std::set<uint64_t> socket_inodes();

// Sets congestion control `name` on each connected TCP socket of this process whose inode is not in `before`
// and none of whose ends is on `skip_port` (the rendezvous store's; 0: none): the connections opened since
// `before`. Never throws: a tuning the kernel refuses on a connection leaves that connection as it was (the
// job runs on), and is counted with the first refusal's reason.
struct CongestionSet {
  size_t set = 0, refused = 0;
  std::string first_refusal;  // "the connection to port 1234: Operation not permitted"
};
CongestionSet set_congestion_control(const std::string& name, const std::set<uint64_t>& before, uint16_t skip_port);

}  // namespace powersgd::transport
