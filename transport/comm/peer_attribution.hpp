// Which peer a failed collective is about, from what Gloo said and the kernel's
// socket table. Pure functions of their inputs (unit-tested with canned Gloo
// messages and canned /proc/net/tcp tables: tests/unit/test_transport.cpp);
// only established_connections() reads the live table. Private to transport.
#pragma once

#include <cstdint>
#include <istream>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace powersgd::transport {

// Local port -> remote port (host byte order) of established IPv4 TCP connections.
using ConnectionTable = std::map<uint16_t, uint16_t>;

// What the fingerprint exchange learns about each rank's pair with this rank.
struct PeerTable {
  // rank -> "[ip]:port" as Gloo's error messages print that peer; empty if unknown.
  std::vector<std::string> addresses;
  // rank -> (local, remote) port of this rank's connection to it; (0, 0) if unknown.
  std::vector<std::pair<uint16_t, uint16_t>> sockets;
};

// Splits a TCP pair address as Gloo prints it ("[ip]:port", optionally followed
// by "$seq") into ip and port: the port is the raw network-order sin_port read as
// a native integer, as Gloo prints it (ntohs gives the real port). {"", 0} if the
// text is not of that form.
std::pair<std::string, uint16_t> split_pair_address(const std::string& text);

// Parses the kernel's IPv4 socket table (the text of /proc/net/tcp, header line
// first) into its established connections. Lines that do not parse are skipped.
ConnectionTable parse_tcp_table(std::istream& table);

// This process's established IPv4 connections from /proc/net/tcp; empty when
// /proc is unavailable.
ConnectionTable established_connections();

// The rank a Gloo error message is about, or -1:
// 1. the rank whose pair address appears in `message` ("[ip]:1234" does not match "[ip]:12345");
// 2. else (Gloo prints a reset connection's peer from getpeername() on the dead
//    socket, i.e. garbage) the first rank whose known connection is no longer
//    established in `connections`, or now leads elsewhere.
int attribute_peer(const PeerTable& peers, const std::string& message, const ConnectionTable& connections);
// Only step 1 of attribute_peer: the rank whose pair address `message` names, or -1. For a timeout: Gloo's names
// no peer, and a connection closed meanwhile is most often another rank that timed out first, not the culprit.
int peer_named_in(const PeerTable& peers, const std::string& message);

// True when a Gloo or store message reports a timeout rather than a broken connection.
bool is_timeout_message(const std::string& message);

}  // namespace powersgd::transport
