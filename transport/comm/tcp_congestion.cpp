#include "comm/tcp_congestion.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/fd.hpp"

namespace powersgd::transport {

namespace {

std::string read_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// (descriptor, inode) of this process's open sockets.
std::vector<std::pair<int, uint64_t>> open_sockets() {
  std::vector<std::pair<int, uint64_t>> sockets;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return sockets;
  while (const dirent* entry = ::readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
    struct stat st {};
    if (::fstat(static_cast<int>(fd), &st) == 0 && S_ISSOCK(st.st_mode))
      sockets.emplace_back(static_cast<int>(fd), static_cast<uint64_t>(st.st_ino));
  }
  ::closedir(dir);
  return sockets;
}

// The port of an IPv4 or IPv6 socket address (host order); 0 for another family.
uint16_t port_of(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
  if (address.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
  return 0;
}

}  // namespace

std::string tcp_congestion_from_env() {
  const std::string name = env::get_or_default("PSGD_TCP_CONGESTION");
  if (name.empty()) return name;
  const Fd probe(::socket(AF_INET, SOCK_STREAM, 0));
  PSGD_REQUIRE(probe.get() >= 0, IoError, "PSGD_TCP_CONGESTION: a socket to check '", name, "' on: ",
               std::strerror(errno));
  if (::setsockopt(probe.get(), IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) != 0) {
    const int err = errno;
    PSGD_THROW(InvalidArgumentError, "environment variable PSGD_TCP_CONGESTION='", name, "' cannot be set here (",
               std::strerror(err), "): expected one of net.ipv4.tcp_allowed_congestion_control (",
               read_line("/proc/sys/net/ipv4/tcp_allowed_congestion_control"),
               "; any of net.ipv4.tcp_available_congestion_control, ",
               read_line("/proc/sys/net/ipv4/tcp_available_congestion_control"),
               ", with CAP_NET_ADMIN), or empty for the host's (",
               read_line("/proc/sys/net/ipv4/tcp_congestion_control"), ")");
  }
  return name;
}

std::set<uint64_t> socket_inodes() {
  std::set<uint64_t> inodes;
  for (const auto& [fd, inode] : open_sockets()) inodes.insert(inode);
  return inodes;
}

CongestionSet set_congestion_control(const std::string& name, const std::set<uint64_t>& before, uint16_t skip_port) {
  CongestionSet result;
  for (const auto& [fd, inode] : open_sockets()) {
    if (before.count(inode) != 0) continue;
    int type = 0;
    socklen_t length = sizeof(type);
    if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &length) != 0 || type != SOCK_STREAM) continue;
    sockaddr_storage local{}, peer{};
    socklen_t local_length = sizeof(local), peer_length = sizeof(peer);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_length) != 0 ||
        ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length) != 0)
      continue;  // not connected: a listening socket
    if (local.ss_family != AF_INET && local.ss_family != AF_INET6) continue;  // a Unix socket
    if (skip_port != 0 && (port_of(local) == skip_port || port_of(peer) == skip_port)) continue;
    // The descriptor may have been closed and reused since it was listed: still the same socket?
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_ino) != inode) continue;
    if (::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) == 0) {
      ++result.set;
    } else if (result.refused++ == 0) {
      result.first_refusal = detail::concat("the connection to port ", port_of(peer), ": ", std::strerror(errno));
    }
  }
  return result;
}

}  // namespace powersgd::transport
