// libFuzzer target: a whole TCP store server session (transport/store). Per
// input, a real TcpStoreServer starts on 127.0.0.1, port 0, and a client
// connects, optionally authenticates with a valid HELLO (first input byte), sends
// the rest of the input as raw bytes, half-closes, and reads the replies until
// the server closes or a short deadline passes. Checked, besides ASan/UBSan and
// the server staying up: every reply is a well-formed frame with a reply type,
// and a client that did not authenticate never gets Ok unless its bytes carry
// the token.
#include <fuzzer/FuzzedDataProvider.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "store/protocol.hpp"
#include "store/store.hpp"

namespace {

namespace protocol = powersgd::transport::protocol;
using Clock = std::chrono::steady_clock;

const std::string kToken = "fuzz-job-token";
// Past this after the last byte sent, the client gives up on more replies (a
// GET or WAIT of a key that never comes keeps the connection open).
constexpr auto kReplyDeadline = std::chrono::milliseconds(30);

void expect(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_store_session: property violated: %s\n", what);
    std::abort();
  }
}

// A fresh server per input: the store's keys never carry over, so every finding
// reproduces from its input alone and memory stays bounded.
std::unique_ptr<powersgd::transport::TcpStoreServer> start_server() {
  powersgd::transport::TcpStoreServerOptions options;
  options.bind_address = "127.0.0.1";
  options.token = kToken;
  options.frame_timeout = std::chrono::milliseconds(200);
  return std::make_unique<powersgd::transport::TcpStoreServer>(options);
}

int connect_to(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  expect(fd >= 0, "socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // The client's own resources can run out (EADDRNOTAVAIL: every ephemeral port to this server's port is in
  // use or in TIME_WAIT; EAGAIN: the same on older kernels): that is the harness's limit, not a property of
  // the server, so wait for the kernel to free a port (bounded). Any other failure is the server's.
  int rc = -1;
  for (int attempt = 0; attempt < 2000; ++attempt) {
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
    if (rc != 0 && errno == EINTR) {
      // libFuzzer's timer signal interrupted the blocking connect; the connection goes on: wait for it.
      pollfd p{fd, POLLOUT, 0};
      int polled;
      do polled = ::poll(&p, 1, 5000);
      while (polled < 0 && errno == EINTR);
      int error = ETIMEDOUT;
      socklen_t length = sizeof error;
      if (polled == 1) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
      rc = error == 0 ? 0 : -1;
      errno = error;
    }
    if (rc == 0 || (errno != EADDRNOTAVAIL && errno != EAGAIN)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (rc != 0) {
    std::fprintf(stderr, "fuzz_store_session: connect to 127.0.0.1:%u failed: %s\n", unsigned(port),
                 std::strerror(errno));
    expect(false, "connect to the store server");
  }
  // Close with RST: no TIME_WAIT per input, so loopback ports are never exhausted.
  linger no_linger{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &no_linger, sizeof no_linger);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

// Sends what the server accepts; stops quietly when it has closed.
void send_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;  // libFuzzer's timer signal
    if (n <= 0) return;
    data += n;
    size -= static_cast<size_t>(n);
  }
}

std::vector<char> hello_frame() {
  return protocol::Writer(static_cast<uint8_t>(protocol::Request::Hello)).u32(protocol::kVersion).str(kToken).finish();
}

// Reads until EOF or the deadline; returns the bytes.
std::string read_replies(int fd) {
  std::string replies;
  const auto deadline = Clock::now() + kReplyDeadline;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    const int polled = ::poll(&p, 1, static_cast<int>(left));
    if (polled < 0 && errno == EINTR) continue;  // libFuzzer's timer signal
    if (polled <= 0) break;
    char buffer[4096];
    ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    replies.append(buffer, static_cast<size_t>(n));
  }
  return replies;
}

void check_replies(const std::string& replies, bool authenticated, const uint8_t* data, size_t size) {
  const bool token_sent =
      ::memmem(data, size, kToken.data(), kToken.size()) != nullptr;
  size_t at = 0;
  while (replies.size() - at >= 4) {
    const uint32_t length = protocol::decode_u32(reinterpret_cast<const unsigned char*>(replies.data() + at));
    if (length > replies.size() - at - 4) break;  // cut by the deadline
    expect(length >= 1 && length <= protocol::kMaxFrameBytes, "a reply frame with a bad length");
    const auto type = static_cast<uint8_t>(replies[at + 4]);
    expect(type >= static_cast<uint8_t>(protocol::Reply::Ok) && type <= static_cast<uint8_t>(protocol::Reply::Busy),
           "a reply frame with an unknown type");
    if (type == static_cast<uint8_t>(protocol::Reply::Ok))
      expect(authenticated || token_sent, "Ok to a client that never sent the token");
    at += 4 + length;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool authenticate = (data[0] & 1) != 0;
  ++data;
  --size;
  auto server = start_server();
  int fd = connect_to(server->port());
  if (authenticate) {
    std::vector<char> hello = hello_frame();
    send_all(fd, hello.data(), hello.size());
  }
  send_all(fd, reinterpret_cast<const char*>(data), size);
  ::shutdown(fd, SHUT_WR);
  std::string replies = read_replies(fd);
  ::close(fd);
  server->stop();
  check_replies(replies, authenticate, data, size);
  return 0;
}
