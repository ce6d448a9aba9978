#include "comm/address.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>

#include "common/check.hpp"

namespace powersgd::transport {
namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfo resolve(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* result = nullptr;
  int rc = getaddrinfo(host.c_str(), "9", &hints, &result);
  PSGD_REQUIRE(rc == 0, IoError, "cannot resolve MASTER_ADDR '", host, "': ", gai_strerror(rc),
               " (set PSGD_ADDR or PSGD_IFACE to choose the local address explicitly)");
  return AddrInfo(result);
}

bool is_loopback_sockaddr(const sockaddr* addr) {
  if (addr->sa_family == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr) >> 24) == 127;
  if (addr->sa_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
  }
  return false;
}

}  // namespace

bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  AddrInfo info = resolve(host);
  for (addrinfo* p = info.get(); p != nullptr; p = p->ai_next)
    if (!is_loopback_sockaddr(p->ai_addr)) return false;
  return true;
}

std::string local_address_towards(const std::string& host) {
  if (is_loopback(host)) return "127.0.0.1";
  AddrInfo info = resolve(host);
  const addrinfo* target = info.get();
  int fd = PSGD_CHECK_SYS(socket(target->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  int rc = connect(fd, target->ai_addr, target->ai_addrlen);
  int err = errno;
  if (rc == 0) {
    rc = getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length);
    err = errno;
  }
  close(fd);
  PSGD_REQUIRE(rc == 0, IoError, "cannot find the local address that reaches MASTER_ADDR '", host,
               "': ", std::strerror(err), " (set PSGD_ADDR or PSGD_IFACE)");
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw = local.ss_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&local)->sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr);
  PSGD_REQUIRE(inet_ntop(local.ss_family, raw, text, sizeof(text)) != nullptr, IoError,
               "inet_ntop failed for the local address towards '", host, "'");
  return text;
}

}  // namespace powersgd::transport
