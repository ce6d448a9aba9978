#include "comm/fingerprint.hpp"

#include "comm/options.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/check.hpp"
#include "common/log.hpp"
#include "powersgd_build_config.h"

namespace powersgd::transport {

Fingerprint make_fingerprint(const CommOptions& options, GlooApi api, size_t direct_max_bytes, HostStageMode host_stage,
                             bool eager_direct, bool scatter_gather) {
  Fingerprint header{};
  std::snprintf(header.version, sizeof(header.version), "%s", PSGD_VERSION);
  header.world_size = options.world_size;
  header.transport = static_cast<int32_t>(options.transport);
  header.api = static_cast<int32_t>(api);
  header.ring_threshold_bytes = options.ring_threshold_bytes;
  header.direct_max_bytes = direct_max_bytes;
  header.flags = static_cast<uint16_t>((host_stage == HostStageMode::On ? kFlagHostStage : 0) |
                                       (host_stage == HostStageMode::Auto ? kFlagHostStageAuto : 0) |
                                       (eager_direct ? 0 : kFlagDirectNotEager) |
                                       (scatter_gather ? 0 : kFlagNoScatterGather));
  header.wire_revision = kWireRevision;
  return header;
}

void require_same_fingerprints(const std::vector<Fingerprint>& all) {
  const Fingerprint& ref = all.at(0);
  for (size_t r = 1; r < all.size(); ++r) {
    const Fingerprint& f = all[r];
    std::string diff;
    auto field = [&](const char* name, const auto& a, const auto& b) {
      if (!(a == b)) diff += detail::concat(diff.empty() ? "" : ", ", name, " ", b, " (rank 0: ", a, ")");
    };
    field("version", std::string(ref.version, strnlen(ref.version, sizeof(ref.version))),
          std::string(f.version, strnlen(f.version, sizeof(f.version))));
    field("wire revision", ref.wire_revision, f.wire_revision);
    field("world size", ref.world_size, f.world_size);
    field("transport", ref.transport == 0 ? "tcp" : "ibverbs", f.transport == 0 ? "tcp" : "ibverbs");
    field("gloo api", ref.api == 0 ? "new" : "legacy", f.api == 0 ? "new" : "legacy");
    field("PSGD_RING_THRESHOLD_BYTES", ref.ring_threshold_bytes, f.ring_threshold_bytes);
    // Before the bound: with PSGD_DIRECT_MAX_BYTES unset it follows PSGD_SCATTER_GATHER (options.hpp), so the
    // setting the user changed is named first.
    field("PSGD_SCATTER_GATHER", ref.flags & kFlagNoScatterGather ? 0 : 1, f.flags & kFlagNoScatterGather ? 0 : 1);
    const auto direct = [](uint64_t bytes) { return bytes == kDirectAuto ? std::string("auto") : std::to_string(bytes); };
    field("PSGD_DIRECT_MAX_BYTES", direct(ref.direct_max_bytes), direct(f.direct_max_bytes));
    const auto stage = [](uint16_t flags) {
      return std::string(flags & kFlagHostStageAuto ? "auto" : flags & kFlagHostStage ? "1" : "0");
    };
    field("PSGD_HOST_STAGE", stage(ref.flags), stage(f.flags));
    field("PSGD_DIRECT_EAGER", ref.flags & kFlagDirectNotEager ? 0 : 1, f.flags & kFlagDirectNotEager ? 0 : 1);
    PSGD_REQUIRE(diff.empty(), MismatchError, "process group configuration mismatch: rank ", r, " has ", diff,
                 "; every rank must use the same powersgd version and PSGD_* settings");
  }
}

std::string fingerprint_key(int rank) { return "fingerprint/" + std::to_string(rank); }

std::vector<uint8_t> creation_record(const CommOptions& options, GlooApi api, size_t direct_max_bytes,
                                     HostStageMode host_stage, bool eager_direct, bool scatter_gather,
                                     const std::vector<std::string>& pair_addresses) {
  const size_t n = static_cast<size_t>(options.world_size);
  const size_t rank = static_cast<size_t>(options.rank);
  PSGD_ASSERT(pair_addresses.size() == n, pair_addresses.size(), " pair addresses for ", n, " ranks");
  std::vector<uint8_t> mine(sizeof(Fingerprint) + n * sizeof(uint16_t), 0);
  Fingerprint header = make_fingerprint(options, api, direct_max_bytes, host_stage, eager_direct, scatter_gather);
  for (size_t peer = 0; peer < n; ++peer) {
    if (peer == rank) continue;
    auto [ip, port] = split_pair_address(pair_addresses[peer]);
    std::snprintf(header.ip, sizeof(header.ip), "%s", ip.c_str());
    std::memcpy(mine.data() + sizeof(Fingerprint) + peer * sizeof(uint16_t), &port, sizeof(port));
  }
  std::memcpy(mine.data(), &header, sizeof(header));
  return mine;
}

PeerTable compare_records(const CommOptions& options, const std::vector<std::vector<uint8_t>>& records,
                          const std::vector<std::string>& pair_addresses, const ConnectionTable& established) {
  const size_t n = static_cast<size_t>(options.world_size);
  const size_t rank = static_cast<size_t>(options.rank);
  const size_t size = sizeof(Fingerprint) + n * sizeof(uint16_t);
  PSGD_ASSERT(records.size() == n, records.size(), " records for ", n, " ranks");
  std::vector<Fingerprint> all(n);
  PeerTable peers;
  peers.addresses.assign(n, std::string());
  peers.sockets.assign(n, {0, 0});
  for (size_t r = 0; r < n; ++r) {
    PSGD_REQUIRE(records[r].size() == size, MismatchError, "process group configuration mismatch: rank ", r,
                 "'s creation record has ", records[r].size(), " bytes (rank ", rank, "'s: ", size,
                 "); every rank must use the same powersgd version and PSGD_* settings");
    const uint8_t* base = records[r].data();
    std::memcpy(&all[r], base, sizeof(Fingerprint));
    uint16_t port = 0;
    std::memcpy(&port, base + sizeof(Fingerprint) + rank * sizeof(uint16_t), sizeof(port));
    std::string ip(all[r].ip, strnlen(all[r].ip, sizeof(all[r].ip)));
    if (port != 0 && all[r].world_size == options.world_size)
      peers.addresses[r] = detail::concat("[", ip, "]:", port);
    if (r == rank) continue;
    uint16_t local = ntohs(split_pair_address(pair_addresses[r]).second);
    if (auto it = established.find(local); local != 0 && it != established.end()) peers.sockets[r] = {local, it->second};
  }
  if (log::enabled(log::Level::Debug)) {
    std::string table;
    for (size_t r = 0; r < n; ++r)
      table += detail::concat(" ", r, "=", peers.addresses[r], " (local port ", peers.sockets[r].first, ")");
    PSGD_LOG(Debug, "peers' pair addresses towards this rank:", table);
  }
  require_same_fingerprints(all);
  return peers;
}

PeerTable exchange_fingerprints(const CommOptions& options, GlooApi api, size_t direct_max_bytes,
                                HostStageMode host_stage, bool eager_direct, bool scatter_gather,
                                const std::vector<std::string>& pair_addresses,
                                const std::function<void(const void* in, void* out, size_t bytes)>& allgather,
                                const std::function<ConnectionTable()>& connections) {
  const size_t n = static_cast<size_t>(options.world_size);
  const std::vector<uint8_t> mine =
      creation_record(options, api, direct_max_bytes, host_stage, eager_direct, scatter_gather, pair_addresses);
  std::vector<uint8_t> gathered(mine.size() * n);
  allgather(mine.data(), gathered.data(), mine.size());
  std::vector<std::vector<uint8_t>> records(n);
  for (size_t r = 0; r < n; ++r)
    records[r].assign(gathered.begin() + static_cast<std::ptrdiff_t>(r * mine.size()),
                      gathered.begin() + static_cast<std::ptrdiff_t>((r + 1) * mine.size()));
  return compare_records(options, records, pair_addresses, connections());
}

PeerTable read_fingerprints(const CommOptions& options, Store& store, const std::vector<std::string>& pair_addresses,
                            const std::function<ConnectionTable()>& connections) {
  const int n = options.world_size;
  // Present: every rank published its record before its byte of the all-to-all this rank has received.
  const int per_get = static_cast<int>(
      Store::keys_per_get_many(sizeof(Fingerprint) + static_cast<size_t>(n) * sizeof(uint16_t)));
  std::vector<std::vector<uint8_t>> records;
  records.reserve(static_cast<size_t>(n));
  for (int first = 0; first < n; first += per_get) {
    std::vector<std::string> keys;
    for (int r = first; r < std::min(n, first + per_get); ++r) keys.push_back(fingerprint_key(r));
    for (const std::vector<char>& value : store.get_many(keys, store.timeout()))
      records.emplace_back(value.begin(), value.end());
  }
  return compare_records(options, records, pair_addresses, connections());
}

}  // namespace powersgd::transport
