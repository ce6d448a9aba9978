#include "comm/address.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <cerrno>
#include <memory>

#include "common/check.hpp"
#include "common/fd.hpp"

namespace powersgd::transport {
namespace {

std::string fix_note(const HostRole& role) {
  return role.fix[0] == '\0' ? std::string() : detail::concat(" (", role.fix, ")");
}

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// getaddrinfo's error as text.
std::string lookup_error(int rc) {
  return rc == EAI_SYSTEM ? detail::errno_text(errno) : std::string(gai_strerror(rc));
}

// Name resolution only; `rc` is getaddrinfo's result. `service`: the port in
// the results (nullptr: 0).
AddrInfo lookup(const std::string& host, int socktype, const char* service, int& rc) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socktype;
  addrinfo* result = nullptr;
  rc = getaddrinfo(host.c_str(), service, &hints, &result);
  return AddrInfo(rc == 0 ? result : nullptr);
}

AddrInfo resolve(const std::string& host, const HostRole& role) {
  int rc = 0;
  // Port 9 (discard): connect() on a UDP socket wants one, and sends nothing to it.
  AddrInfo info = lookup(host, SOCK_DGRAM, "9", rc);
  PSGD_REQUIRE(rc == 0, IoError, role.role, " '", host, "' does not resolve: ", lookup_error(rc), fix_note(role));
  return info;
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

bool is_loopback(const std::string& host, const HostRole& role) {
  if (host == "localhost") return true;
  AddrInfo info = resolve(host, role);
  for (addrinfo* p = info.get(); p != nullptr; p = p->ai_next)
    if (!is_loopback_sockaddr(p->ai_addr)) return false;
  return true;
}

std::string local_address_towards(const std::string& host, const HostRole& role) {
  if (is_loopback(host, role)) return "127.0.0.1";
  AddrInfo info = resolve(host, role);
  int err = EADDRNOTAVAIL;
  for (const addrinfo* p = info.get(); p != nullptr; p = p->ai_next) {
    Fd socket(::socket(p->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (!socket || ::connect(socket.get(), p->ai_addr, p->ai_addrlen) != 0 ||
        ::getsockname(socket.get(), reinterpret_cast<sockaddr*>(&local), &length) != 0) {
      err = errno;  // try the host's next address
      continue;
    }
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw = local.ss_family == AF_INET
                          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&local)->sin_addr)
                          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr);
    if (::inet_ntop(local.ss_family, raw, text, sizeof(text)) != nullptr) return text;
    err = errno;
  }
  PSGD_THROW(IoError, "cannot find the local address that reaches ", role.role, " '", host,
             "': ", detail::errno_text(err), fix_note(role));
}

void require_bindable(const std::string& address) {
  int rc = 0;
  AddrInfo info = lookup(address, SOCK_STREAM, nullptr, rc);  // port 0: any free port
  PSGD_REQUIRE(rc == 0, InvalidArgumentError, "PSGD_ADDR='", address, "' does not resolve: ", lookup_error(rc),
               " (expected a local address or hostname)");
  int err = EADDRNOTAVAIL;
  for (const addrinfo* p = info.get(); p != nullptr; p = p->ai_next) {
    // Each of the address's families in turn: a failure only matters if all fail.
    Fd socket(::socket(p->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (socket && ::bind(socket.get(), p->ai_addr, p->ai_addrlen) == 0) return;
    err = errno;
  }
  PSGD_REQUIRE(false, InvalidArgumentError, "PSGD_ADDR='", address, "' cannot be bound on this host: ",
               detail::errno_text(err), " (expected an address of one of this host's interfaces)");
}

}  // namespace powersgd::transport
