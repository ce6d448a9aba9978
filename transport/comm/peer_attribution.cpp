#include "comm/peer_attribution.hpp"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>

namespace powersgd::transport {

std::pair<std::string, uint16_t> split_pair_address(const std::string& text) {
  size_t open = text.find('[');
  size_t close = text.find("]:");
  if (open != 0 || close == std::string::npos) return {"", 0};
  unsigned long port = std::strtoul(text.c_str() + close + 2, nullptr, 10);
  return {text.substr(1, close - 1), static_cast<uint16_t>(port <= 65535 ? port : 0)};
}

ConnectionTable parse_tcp_table(std::istream& table) {
  ConnectionTable connections;
  std::string line;
  std::getline(table, line);  // header
  while (std::getline(table, line)) {
    unsigned local_ip = 0, local_port = 0, remote_ip = 0, remote_port = 0, state = 0;
    if (std::sscanf(line.c_str(), " %*u: %8X:%4X %8X:%4X %2X", &local_ip, &local_port, &remote_ip, &remote_port,
                    &state) == 5 &&
        state == 1 /* TCP_ESTABLISHED */)
      connections[static_cast<uint16_t>(local_port)] = static_cast<uint16_t>(remote_port);
  }
  return connections;
}

ConnectionTable established_connections() {
  std::ifstream table("/proc/net/tcp");
  return parse_tcp_table(table);
}

int peer_named_in(const PeerTable& peers, const std::string& message) {
  for (size_t r = 0; r < peers.addresses.size(); ++r) {
    const std::string& address = peers.addresses[r];
    size_t at = address.empty() ? std::string::npos : message.find(address);
    if (at != std::string::npos && !std::isdigit(static_cast<unsigned char>(message[at + address.size()])))
      return static_cast<int>(r);
  }
  return -1;
}

int attribute_peer(const PeerTable& peers, const std::string& message, const ConnectionTable& connections) {
  if (const int named = peer_named_in(peers, message); named >= 0) return named;
  for (size_t r = 0; r < peers.sockets.size(); ++r) {
    auto [local, remote] = peers.sockets[r];
    auto it = connections.find(local);
    if (local != 0 && (it == connections.end() || it->second != remote)) return static_cast<int>(r);
  }
  return -1;
}

bool is_timeout_message(const std::string& message) {
  return message.find("Timed out") != std::string::npos || message.find("timeout") != std::string::npos ||
         message.find("Timeout") != std::string::npos;
}

}  // namespace powersgd::transport
