#include "comm/host_stage.hpp"

#include <gloo/common/error.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>

#include "common/check.hpp"
#include "common/env.hpp"

namespace powersgd::transport {
namespace {

// Slot prefixes of the hops within a host, apart from Gloo's collectives' (0x01-0x08, gloo/types.h).
constexpr uint8_t kToLeaderSlotPrefix = 0x50;
constexpr uint8_t kFromLeaderSlotPrefix = 0x51;

}  // namespace

bool host_stage_from_env() {
  const std::string value = env::get_or_default("PSGD_HOST_STAGE");
  PSGD_REQUIRE(value == "0" || value == "1", InvalidArgumentError, "environment variable PSGD_HOST_STAGE='", value,
               "' is invalid: expected 0 (off) or 1 (host-staged allreduce)");
  return value == "1";
}

std::string host_key(const std::string& ip) {
  if (auto id = env::get("PSGD_HOST_ID")) return *id;
  char name[HOST_NAME_MAX + 1] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  return std::string(name) + " " + ip;
}

bool HostGroups::degenerate() const {
  return hosts.size() < 2 ||
         std::all_of(hosts.begin(), hosts.end(), [](const std::vector<int>& ranks) { return ranks.size() == 1; });
}

std::string HostGroups::describe() const {
  std::string text = detail::concat(hosts.size(), hosts.size() == 1 ? " host:" : " hosts:");
  for (const auto& ranks : hosts) {
    text += " {";
    for (size_t i = 0; i < ranks.size(); ++i) text += detail::concat(i == 0 ? "" : ", ", ranks[i]);
    text += "}";
  }
  return text;
}

HostGroups group_hosts(const std::vector<std::string>& keys) {
  HostGroups groups;
  groups.host_of.assign(keys.size(), -1);
  std::map<std::string, int> index;  // key -> host, in the order of the hosts' lowest ranks
  for (size_t r = 0; r < keys.size(); ++r) {
    auto [it, added] = index.emplace(keys[r], static_cast<int>(groups.hosts.size()));
    if (added) groups.hosts.emplace_back();
    groups.hosts[static_cast<size_t>(it->second)].push_back(static_cast<int>(r));
    groups.host_of[r] = it->second;
  }
  return groups;
}

std::vector<std::string> exchange_host_keys(const std::string& mine, int world_size,
                                            const std::function<void(const void*, void*, size_t)>& allgather) {
  const size_t n = static_cast<size_t>(world_size);
  const uint64_t length = mine.size();
  std::vector<uint64_t> lengths(n);
  allgather(&length, lengths.data(), sizeof(length));
  const size_t longest = static_cast<size_t>(*std::max_element(lengths.begin(), lengths.end()));
  std::vector<char> padded(std::max<size_t>(longest, 1), '\0'), all(padded.size() * n);
  std::memcpy(padded.data(), mine.data(), mine.size());
  allgather(padded.data(), all.data(), padded.size());
  std::vector<std::string> keys(n);
  for (size_t r = 0; r < n; ++r) keys[r].assign(all.data() + r * padded.size(), static_cast<size_t>(lengths[r]));
  return keys;
}

HostStage::HostStage(HostGroups groups, int rank, std::shared_ptr<gloo::Context> leaders,
                     std::chrono::milliseconds timeout)
    : groups_(std::move(groups)), rank_(rank), leaders_(std::move(leaders)), timeout_(timeout) {}

void HostStage::allreduce(const std::shared_ptr<gloo::Context>& global, uint32_t tag, void* data, size_t count,
                          DataType type, Algorithm inter, CollectiveAlgorithms& algorithms) {
  const size_t bytes = count * size_of(type);
  const std::vector<int>& host = groups_.hosts[static_cast<size_t>(groups_.host_of[static_cast<size_t>(rank_)])];
  const int leader = host.front();
  const uint64_t to_leader = gloo::Slot::build(kToLeaderSlotPrefix, tag);
  const uint64_t from_leader = gloo::Slot::build(kFromLeaderSlotPrefix, tag);
  if (rank_ != leader) {
    // The leader sends the result only once it has every byte of this send, so the buffer is free by then.
    auto buffer = global->createUnboundBuffer(data, bytes);
    buffer->send(leader, to_leader);
    require_done(buffer->waitSend(timeout_), "send to the host's leader");
    buffer->recv(leader, from_leader);
    require_done(buffer->waitRecv(timeout_), "receive from the host's leader");
    return;
  }
  PSGD_ASSERT(leaders_ != nullptr, "rank ", rank_, " leads a host but has no leaders' context");
  // Every other rank of the host at once, then added in rank order: the additions, and so the bits, do not
  // depend on which arrives first.
  const size_t others = host.size() - 1;
  if (received_.size() < others * bytes) received_.resize(others * bytes);
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> in;
  for (size_t i = 0; i < others; ++i) {
    in.push_back(global->createUnboundBuffer(received_.data() + i * bytes, bytes));
    in.back()->recv(host[i + 1], to_leader);
  }
  const SumFn sum = sum_function(type);
  for (size_t i = 0; i < others; ++i) {
    require_done(in[i]->waitRecv(timeout_), "receive from a rank of the host");
    sum(data, data, received_.data() + i * bytes, count);
  }
  algorithms.allreduce(leaders_, tag, data, count, type, inter);
  if (others == 0) return;
  auto out = global->createUnboundBuffer(data, bytes);
  for (size_t i = 0; i < others; ++i) out->send(host[i + 1], from_leader);
  for (size_t i = 0; i < others; ++i) require_done(out->waitSend(timeout_), "send to a rank of the host");
}

}  // namespace powersgd::transport
