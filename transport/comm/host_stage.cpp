#include "comm/host_stage.hpp"

#include <gloo/common/error.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <map>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/log.hpp"

namespace powersgd::transport {
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

std::vector<HostReport> exchange_host_reports(const HostReport& mine, int world_size,
                                              const std::function<void(const void*, void*, size_t)>& allgather) {
  const size_t n = static_cast<size_t>(world_size);
  const uint64_t head[2] = {mine.key.size(), mine.spare_descriptors};
  std::vector<uint64_t> heads(2 * n);
  allgather(head, heads.data(), sizeof(head));
  size_t longest = 0;
  for (size_t r = 0; r < n; ++r) longest = std::max(longest, static_cast<size_t>(heads[2 * r]));
  std::vector<char> padded(std::max<size_t>(longest, 1), '\0'), all(padded.size() * n);
  std::memcpy(padded.data(), mine.key.data(), mine.key.size());
  allgather(padded.data(), all.data(), padded.size());
  std::vector<HostReport> reports(n);
  for (size_t r = 0; r < n; ++r) {
    reports[r].key.assign(all.data() + r * padded.size(), static_cast<size_t>(heads[2 * r]));
    reports[r].spare_descriptors = heads[2 * r + 1];
  }
  return reports;
}

int leader_short_of_descriptors(const HostGroups& groups, const std::vector<HostReport>& reports) {
  const uint64_t needed = leader_descriptors(groups.hosts.size());
  for (const auto& ranks : groups.hosts)
    if (reports.at(static_cast<size_t>(ranks.front())).spare_descriptors < needed) return ranks.front();
  return -1;
}

HostStage::HostStage(HostGroups groups, int rank, std::shared_ptr<gloo::Context> leaders,
                     std::chrono::milliseconds timeout)
    : groups_(std::move(groups)), rank_(rank), leaders_(std::move(leaders)), timeout_(timeout) {
  for (const auto& ranks : groups_.hosts) largest_host_ = std::max(largest_host_, ranks.size());
}

namespace {

// The slots of the hops within a host: apart from Gloo's collectives' (0x01-0x08, gloo/types.h) and the
// communicator's own (0x52-0x54 and 0x5c, algorithms.cpp), and each kind of message its own, so that ranks at different
// operations time out rather than read one's message as the other's.
// The staged allreduce: a rank's header (its count and type) and data to its leader, the leader's status and
// the sum (or the rank's own data) back.
constexpr uint8_t kAllreduceHeaderSlot = 0x57, kAllreduceDataSlot = 0x50, kAllreduceStatusSlot = 0x58,
                  kAllreduceReplySlot = 0x51;
// The staged lead exchange: a rank's message to its leader, the leader's reply.
constexpr uint8_t kLeadExchangeSlot = 0x55, kLeadExchangeReplySlot = 0x56;
// connect_shared_memory: the segment's name to the host's ranks, whether each mapped it, the leader's decision.
constexpr uint8_t kShmNameSlot = 0x59, kShmMappedSlot = 0x5a, kShmDecisionSlot = 0x5b;
// Each way between the leader and each other rank of its host.
constexpr size_t kShmRingBytes = size_t{1} << 20;

}  // namespace

// Over TCP: posts every send (or receive) at once, then waits for each, at most the timeout apiece. Through
// shared memory: one message after the other, each within the timeout, each peer's messages in the order its
// ring carries them, so a receiver must take a peer's messages in the order the peer sent them (every caller
// does: header then data, status then reply). A failure names `what`.
void HostStage::transfer(gloo::Context& global, Direction direction, uint32_t tag,
                         const std::vector<HostMessage>& messages, const char* what) const {
  if (shm_ != nullptr) {
    for (const HostMessage& message : messages) {
      const size_t participant = index_in_host(message.peer);
      try {
        if (direction == Direction::Send)
          shm_->send(participant, message.peer, message.slot_prefix, tag, message.data, message.bytes, timeout_);
        else
          shm_->receive(participant, message.peer, message.slot_prefix, tag, message.data, message.bytes, timeout_);
      } catch (const HostHopError& e) {
        throw HostHopError(e.peer(), e.timeout(), detail::concat(what, ": ", e.what()));
      }
    }
    return;
  }
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> posted;
  posted.reserve(messages.size());
  for (const HostMessage& message : messages) {
    posted.push_back(global.createUnboundBuffer(message.data, message.bytes));
    const gloo::Slot slot = gloo::Slot::build(message.slot_prefix, tag);
    if (direction == Direction::Send)
      posted.back()->send(message.peer, slot);
    else
      posted.back()->recv(message.peer, slot);
  }
  for (auto& buffer : posted)
    require_done(direction == Direction::Send ? buffer->waitSend(timeout_) : buffer->waitRecv(timeout_), what);
}

bool HostStage::connect_shared_memory(gloo::Context& global, uint32_t tag, bool wanted) {
  const std::vector<int>& host = my_host();
  if (host.size() < 2) return false;
  const size_t others = host.size() - 1;
  constexpr size_t kNameBytes = 64;
  // A rank's answer to its leader: it does not want shared memory (PSGD_HOST_SHM=0), it mapped the segment and
  // sees its leader's process, or it could not (the reason in its own log).
  constexpr uint8_t kNotWanted = 0, kMapped = 1, kFailed = 2;
  std::unique_ptr<ShmHostLink> link;
  std::string why;
  if (rank_ == host.front()) {
    char name[kNameBytes] = {};
    if (wanted) link = ShmHostLink::create(others, kShmRingBytes, why);
    if (link != nullptr) {
      PSGD_ASSERT(link->name().size() < kNameBytes, "shared-memory segment name ", link->name(), " too long");
      std::memcpy(name, link->name().c_str(), link->name().size());
      link->attach();
    }
    std::vector<HostMessage> messages;
    for (size_t i = 0; i < others; ++i) messages.push_back({host[i + 1], kShmNameSlot, name, kNameBytes});
    transfer(global, Direction::Send, tag, messages, "shared memory setup: send to a rank of the host");
    std::vector<uint8_t> answers(others, kFailed);
    for (size_t i = 0; i < others; ++i) messages[i] = {host[i + 1], kShmMappedSlot, &answers[i], 1};
    transfer(global, Direction::Receive, tag, messages, "shared memory setup: receive from a rank of the host");
    uint8_t decision = link != nullptr ? 1 : 0;
    for (size_t i = 0; i < others && decision == 1; ++i) {
      if (answers[i] == kMapped && link->sees(i + 1)) continue;
      decision = 0;
      why = detail::concat("rank ", host[i + 1],
                           answers[i] == kNotWanted ? " has PSGD_HOST_SHM=0"
                           : answers[i] == kMapped  ? "'s process is not visible from its leader (another pid namespace)"
                                                    : " could not map the segment (its log says why)");
    }
    if (link != nullptr) link->unlink();  // every rank of the host has mapped it or given up
    for (size_t i = 0; i < others; ++i) messages[i] = {host[i + 1], kShmDecisionSlot, &decision, 1};
    transfer(global, Direction::Send, tag, messages, "shared memory setup: send to a rank of the host");
    if (decision == 1) shm_ = std::move(link);
  } else {
    const int leader = host.front();
    const size_t participant = index_in_host(rank_);
    char name[kNameBytes] = {};
    transfer(global, Direction::Receive, tag, {{leader, kShmNameSlot, name, kNameBytes}},
             "shared memory setup: receive from the host's leader");
    name[kNameBytes - 1] = '\0';
    uint8_t answer = kNotWanted;
    if (wanted) {
      answer = kFailed;
      if (name[0] == '\0') {
        why = "its leader has none (the leader's log says why)";
      } else if ((link = ShmHostLink::open(name, participant, why)) != nullptr) {
        link->attach();
        if (link->sees(0))
          answer = kMapped;
        else
          why = "the host's leader's process is not visible from here (another pid namespace)";
      }
    }
    uint8_t decision = 0;
    transfer(global, Direction::Send, tag, {{leader, kShmMappedSlot, &answer, 1}},
             "shared memory setup: send to the host's leader");
    transfer(global, Direction::Receive, tag, {{leader, kShmDecisionSlot, &decision, 1}},
             "shared memory setup: receive from the host's leader");
    if (decision == 1 && answer == kMapped) shm_ = std::move(link);
    if (answer == kMapped && shm_ == nullptr) why = "another rank of the host could not (the leader's log says why)";
  }
  if (shm_ != nullptr)
    PSGD_LOG(Debug, "the hops within this host go through shared memory (", kShmRingBytes >> 10,
             " KiB each way per rank)");
  else if (wanted)
    PSGD_LOG(Info, "the hops within this host go over TCP, not shared memory: ", why);
  return shm_ != nullptr;
}

const std::vector<int>& HostStage::my_host() const {
  return groups_.hosts[static_cast<size_t>(groups_.host_of[static_cast<size_t>(rank_)])];
}

size_t HostStage::index_in_host(int rank) const {
  const std::vector<int>& host = my_host();
  return static_cast<size_t>(std::find(host.begin(), host.end(), rank) - host.begin());
}

namespace {

// The leader's status to a rank: the sum follows (kAllreduceSummed), or the data sent back is the rank's own,
// unchanged, because a rank of the host passed another count or type than the leader (kAllreduceRankMismatch:
// that rank, its header and the leader's) or the leaders' counts differ (kAllreduceLeaderMismatch).
constexpr uint64_t kAllreduceSummed = 0, kAllreduceRankMismatch = 1, kAllreduceLeaderMismatch = 2;
struct AllreduceStatus {
  uint64_t kind = kAllreduceSummed;
  uint64_t rank = 0;
  uint64_t header[2] = {};         // the rank's: bytes, type
  uint64_t leader_header[2] = {};  // the leader's
};

std::string describe_header(const uint64_t header[2]) {
  return detail::concat(header[0], " bytes of ", to_string(static_cast<DataType>(header[1])));
}

// Throws the MismatchError `status` says, on the rank `me` of the host led by `leader`.
[[noreturn]] void throw_allreduce_mismatch(const AllreduceStatus& status, int me, int leader) {
  if (status.kind == kAllreduceRankMismatch)
    PSGD_THROW(MismatchError, "allreduce: rank ", status.rank, " passed ", describe_header(status.header),
               " where its host's leader, rank ", leader, ", passed ", describe_header(status.leader_header),
               " (this rank: ", me, "): every rank must pass the same count and type");
  PSGD_THROW(MismatchError, "allreduce: the hosts' leaders passed different counts or types (this rank: ", me,
             "): every rank must pass the same count and type");
}

}  // namespace

void HostStage::allreduce(const std::shared_ptr<gloo::Context>& global, uint32_t tag, void* data, size_t count,
                          DataType type, Algorithm inter, CollectiveAlgorithms& algorithms) {
  const size_t bytes = count * size_of(type);
  uint64_t header[2] = {bytes, static_cast<uint64_t>(type)};
  const std::vector<int>& host = my_host();
  const int leader = host.front();
  if (rank_ != leader) {
    // The header and the data, then the leader's status and the sum (or this rank's data back, unchanged).
    transfer(*global, Direction::Send, tag,
             {{leader, kAllreduceHeaderSlot, header, sizeof header}, {leader, kAllreduceDataSlot, data, bytes}},
             "send to the host's leader");
    AllreduceStatus status;
    transfer(*global, Direction::Receive, tag,
             {{leader, kAllreduceStatusSlot, &status, sizeof status}, {leader, kAllreduceReplySlot, data, bytes}},
             "receive from the host's leader");
    if (status.kind != kAllreduceSummed) throw_allreduce_mismatch(status, rank_, leader);
    return;
  }
  PSGD_ASSERT(leaders_ != nullptr, "rank ", rank_, " leads a host but has no leaders' context");
  // Every other rank's header, then its data as long as it announced: Gloo aborts the process on a message
  // longer than its receive.
  const size_t others = host.size() - 1;
  headers_.assign(2 * others, 0);
  messages_.clear();
  for (size_t i = 0; i < others; ++i)
    messages_.push_back({host[i + 1], kAllreduceHeaderSlot, &headers_[2 * i], 2 * sizeof(uint64_t)});
  transfer(*global, Direction::Receive, tag, messages_, "receive from a rank of the host");
  // Each rank's data at the sum of the sizes before it: what is kept is what the host's ranks announced.
  AllreduceStatus status;
  std::memcpy(status.leader_header, header, sizeof header);
  size_t kept = 0;
  messages_.clear();
  for (size_t i = 0; i < others; ++i) {
    const size_t announced = static_cast<size_t>(headers_[2 * i]);
    if (status.kind == kAllreduceSummed && (headers_[2 * i] != header[0] || headers_[2 * i + 1] != header[1])) {
      status.kind = kAllreduceRankMismatch;
      status.rank = static_cast<uint64_t>(host[i + 1]);
      std::memcpy(status.header, &headers_[2 * i], sizeof status.header);
    }
    messages_.push_back({host[i + 1], kAllreduceDataSlot, nullptr, announced});
    kept += announced;
  }
  if (received_.size() < kept) received_.resize(kept);
  for (size_t i = 0, offset = 0; i < others; offset += messages_[i].bytes, ++i)
    messages_[i].data = received_.data() + offset;
  transfer(*global, Direction::Receive, tag, messages_, "receive from a rank of the host");
  // To each rank the status, then the sum or, on a mismatch, its own data back (in messages_), so that no
  // rank's data changes and no receive stays posted.
  const auto reply = [&](uint64_t kind) {
    status.kind = kind;
    std::vector<HostMessage> replies;
    for (size_t i = 0; i < others; ++i) {
      replies.push_back({host[i + 1], kAllreduceStatusSlot, &status, sizeof status});
      replies.push_back(kind == kAllreduceSummed ? HostMessage{host[i + 1], kAllreduceReplySlot, data, bytes}
                                                 : HostMessage{host[i + 1], kAllreduceReplySlot, messages_[i].data,
                                                               messages_[i].bytes});
    }
    transfer(*global, Direction::Send, tag, replies, "send to a rank of the host");
  };
  if (status.kind != kAllreduceSummed) {
    reply(status.kind);
    throw_allreduce_mismatch(status, rank_, leader);
  }
  // Added in rank order: the additions, and so the bits, do not depend on which rank's data arrived first.
  add_in_rank_order(data, count, type, host.size(), [&](size_t i) { return i == 0 ? data : messages_[i - 1].data; });
  try {
    algorithms.allreduce(leaders_, tag, data, count, type, inter);
  } catch (const MismatchError& e) {
    reply(kAllreduceLeaderMismatch);
    // The algorithm's, naming the other leader and both sizes by their ranks among the leaders.
    std::string leaders;
    for (const auto& ranks : groups_.hosts) leaders += detail::concat(leaders.empty() ? "" : ", ", ranks.front());
    PSGD_THROW(MismatchError, e.what(), " (among the hosts' leaders, where rank k is host k's leader: ranks ",
               leaders, ")");
  }
  reply(kAllreduceSummed);
}

namespace {

// lead_allreduce's messages. A rank to its leader: kStageHeader bytes (its lead's bytes; the first part's bytes
// with its type in bits 56 and up; the lead's kind in bits 32 and up; the second part's bytes and type), the
// lead, the data (lead_parts_bytes' layout). A leader to its ranks, and each leader's lead among the leaders:
// a status word first.
constexpr size_t kStageHeader = 4 * sizeof(uint64_t);
constexpr size_t kStatus = sizeof(uint64_t);
constexpr int kHeaderKindShift = 32;
// Status words, what happened in bits 0-3: the data not summed / summed; a rank of this host passed another lead
// than its leader (that rank, its lead's bytes and kind in the upper bits); the leaders' leads differ in size;
// a host's leader passed another kind of lead than rank 0 (that leader, its lead's bytes and kind).
// kStatusShapeBit: the lead of the rank named is a public collective's shape. kStatusKindsDifferBit: the rank
// named passed another kind of lead than its leader (else another size).
constexpr uint64_t kNotSummed = 0, kSummed = 1, kRankMismatch = 2, kLeaderMismatch = 3, kKindMismatch = 4;
constexpr uint64_t kStatusWhatMask = 0xf, kStatusShapeBit = 0x10, kStatusKindsDifferBit = 0x20;
constexpr int kStatusRankShift = 8, kStatusBytesShift = 32;

uint64_t shape_bit(LeadKind kind) { return kind == LeadKind::Shape ? kStatusShapeBit : 0; }
LeadKind kind_of_status(uint64_t status) {
  return (status & kStatusShapeBit) != 0 ? LeadKind::Shape : LeadKind::Lead;
}
int rank_of_status(uint64_t status) { return static_cast<int>((status >> kStatusRankShift) & 0xffffff); }

uint64_t mismatch(uint64_t what, int rank, uint64_t lead_bytes, LeadKind kind) {
  return what | shape_bit(kind) | (static_cast<uint64_t>(rank) << kStatusRankShift) |
         (lead_bytes << kStatusBytesShift);
}

// Throws the MismatchError a mismatch status word says, on the rank `me` that passed a lead of `lead_bytes` of
// `kind`.
[[noreturn]] void throw_mismatch(uint64_t status, int me, size_t lead_bytes, LeadKind kind) {
  const std::string mine = detail::concat("this rank, ", me, ": ", describe_lead(kind, lead_bytes));
  const LeadKind theirs = kind_of_status(status);
  const size_t their_bytes = static_cast<size_t>(status >> kStatusBytesShift);
  const char* const same_order = ": every rank must run the same collectives in the same order";
  const char* const same_lead = ": every rank must pass the same lead";
  switch (status & kStatusWhatMask) {
    case kRankMismatch:
      PSGD_THROW(MismatchError, "lead exchange: rank ", rank_of_status(status), " passed ",
                 describe_lead(theirs, their_bytes), " where its host's leader passed another (", mine, ")",
                 (status & kStatusKindsDifferBit) != 0 ? same_order : same_lead);
    case kKindMismatch:  // rank 0's lead: the other kind (its bytes are not in the status word)
      PSGD_THROW(MismatchError, "lead exchange: rank ", rank_of_status(status), ", its host's leader, passed ",
                 describe_lead(theirs, their_bytes), " where rank 0 passed ",
                 theirs == LeadKind::Shape ? "a lead" : describe_lead(LeadKind::Shape, 0), " (", mine, ")",
                 same_order);
    default:
      PSGD_THROW(MismatchError, "lead exchange: the leaders of the hosts passed leads of different sizes (", mine,
                 ")", same_lead);
  }
}

}  // namespace

size_t HostStage::lead_capacity(size_t leaders_capacity) const {
  if (leaders_capacity <= kStatus) return 0;
  return (leaders_capacity - kStatus) / largest_host_ / 64 * 64;
}

bool HostStage::lead_allreduce(const std::shared_ptr<gloo::Context>& global, uint32_t tag, LeadKind kind,
                               const void* lead, void* leads, size_t lead_bytes, std::span<const LeadPart> parts,
                               size_t capacity, CollectiveAlgorithms& algorithms) {
  PSGD_ASSERT(parts.size() <= kMaxLeadParts, parts.size(), " parts");
  // Data that does not fit beside the lead stays behind, as without staging.
  const size_t data_bytes = lead_parts_bytes(parts);
  const bool sent = data_bytes > 0 && data_bytes <= capacity - lead_bytes;
  const size_t bytes = sent ? data_bytes : 0;
  // Each part's exact bytes and type (0 where none is sent): headers alike only for the same parts.
  const auto part_word = [&](size_t i) { return sent && i < parts.size() ? lead_part_word(parts[i]) : 0; };
  const uint64_t header[4] = {lead_bytes, part_word(0), static_cast<uint64_t>(kind) << kHeaderKindShift,
                              part_word(1)};
  const size_t world = groups_.host_of.size();
  const std::vector<int>& host = my_host();
  const size_t reply_bytes = kStatus + world * lead_bytes;  // and the data where it was summed
  if (rank_ != host.front()) {
    lead_out_.resize(kStageHeader + lead_bytes + bytes);
    std::memcpy(lead_out_.data(), header, kStageHeader);
    std::memcpy(lead_out_.data() + kStageHeader, lead, lead_bytes);
    if (sent) pack_lead_parts(parts, lead_out_.data() + kStageHeader + lead_bytes);
    lead_in_.resize(reply_bytes + bytes);  // the leader's reply is at most this long (shorter where not summed)
    transfer(*global, Direction::Send, tag, {{host.front(), kLeadExchangeSlot, lead_out_.data(), lead_out_.size()}},
             "lead exchange: send to the host's leader");
    transfer(*global, Direction::Receive, tag,
             {{host.front(), kLeadExchangeReplySlot, lead_in_.data(), lead_in_.size()}},
             "lead exchange: receive from the host's leader");
    uint64_t status = 0;
    std::memcpy(&status, lead_in_.data(), kStatus);
    if (status != kSummed && status != kNotSummed) throw_mismatch(status, rank_, lead_bytes, kind);
    std::memcpy(leads, lead_in_.data() + kStatus, world * lead_bytes);
    if (status == kSummed) unpack_lead_parts(parts, lead_in_.data() + reply_bytes);
    return status == kSummed;
  }
  PSGD_ASSERT(leaders_ != nullptr, "rank ", rank_, " leads a host but has no leaders' context");
  // The host's other ranks' messages, each at most the capacity behind its header.
  const size_t others = host.size() - 1, stride = kStageHeader + capacity;
  if (received_.size() < others * stride) received_.resize(others * stride);
  messages_.clear();
  for (size_t i = 0; i < others; ++i)
    messages_.push_back({host[i + 1], kLeadExchangeSlot, received_.data() + i * stride, stride});
  transfer(*global, Direction::Receive, tag, messages_, "lead exchange: receive from a rank of the host");
  // This host's status and leads (host order, padded to the largest host) and, where every rank of the host
  // passed the same data as this one, its sum in rank order (the leader's first), in the reply's data: no
  // rank's data changes unless every host's is summed.
  const size_t leaders_lead = kStatus + largest_host_ * lead_bytes;
  std::vector<uint8_t>& host_lead = lead_in_;
  std::vector<uint8_t>& all = leaders_leads_;
  host_lead.assign(leaders_lead, 0);
  all.resize(groups_.hosts.size() * leaders_lead);
  uint64_t status = kNotSummed;
  bool alike = sent;
  std::memcpy(host_lead.data() + kStatus, lead, lead_bytes);
  for (size_t i = 0; i < others; ++i) {
    const uint8_t* message = received_.data() + i * stride;
    uint64_t theirs[4] = {};
    std::memcpy(theirs, message, kStageHeader);
    const auto sent_kind = static_cast<LeadKind>((theirs[2] >> kHeaderKindShift) & 0xff);
    if (theirs[0] != lead_bytes || sent_kind != kind) {
      if (status == kNotSummed)
        status = mismatch(kRankMismatch | (sent_kind != kind ? kStatusKindsDifferBit : 0), host[i + 1], theirs[0],
                          sent_kind);
      alike = false;
      continue;
    }
    alike = alike && std::memcmp(theirs, header, kStageHeader) == 0;
    std::memcpy(host_lead.data() + kStatus + (i + 1) * lead_bytes, message + kStageHeader, lead_bytes);
  }
  std::memcpy(host_lead.data(), &status, kStatus);
  // The reply to the host's ranks (status, every rank's lead, the sum): sent whatever happens among the
  // leaders, so that they fail alike.
  lead_out_.resize(reply_bytes + bytes);
  uint8_t* const sum = lead_out_.data() + reply_bytes;
  // The parts within the host's sum (and the leaders' exchange), each summed in rank order: the leader's first.
  std::array<LeadPart, kMaxLeadParts> summed_parts{};
  for (size_t i = 0; alike && i < parts.size(); ++i) {
    const size_t at = lead_part_offset(parts, i);
    summed_parts[i] = {sum + at, parts[i].count, parts[i].type};
    if (parts[i].count == 0) continue;
    add_in_rank_order(sum + at, parts[i].count, parts[i].type, host.size(), [&](size_t k) -> const void* {
      return k == 0 ? parts[i].data : received_.data() + (k - 1) * stride + kStageHeader + lead_bytes + at;
    });
  }
  const auto reply = [&](uint64_t word, bool with_data) {
    std::memcpy(lead_out_.data(), &word, kStatus);
    const size_t length = word == kSummed || word == kNotSummed ? reply_bytes + (with_data ? bytes : 0) : kStatus;
    for (size_t i = 0; i < others; ++i) messages_[i] = {host[i + 1], kLeadExchangeReplySlot, lead_out_.data(), length};
    transfer(*global, Direction::Send, tag, messages_, "lead exchange: send to a rank of the host");
  };
  const auto fail = [&](uint64_t word) {
    reply(word, false);
    throw_mismatch(word, rank_, lead_bytes, kind);
  };
  bool summed = false;
  try {
    summed = algorithms.lead_allreduce(leaders_, kind, host_lead.data(), all.data(), leaders_lead,
                                       std::span<const LeadPart>(summed_parts.data(), alike ? parts.size() : 0));
  } catch (const LeadKindMismatchError& e) {
    // The leader of host e.rank() (the first whose kind is not rank 0's), its lead's bytes from the leaders'.
    fail(mismatch(kKindMismatch, groups_.hosts[static_cast<size_t>(e.rank())].front(),
                  (e.lead_bytes() - kStatus) / largest_host_, e.kind()));
  } catch (const MismatchError&) {
    fail(kLeaderMismatch);
  }
  // Every leader sees every host's status: the first mismatch within a host fails every rank alike.
  for (size_t k = 0; k < groups_.hosts.size(); ++k) {
    uint64_t word = 0;
    std::memcpy(&word, all.data() + k * leaders_lead, kStatus);
    if (word != kNotSummed) fail(word);
  }
  auto* out = static_cast<uint8_t*>(leads);
  for (size_t k = 0; k < groups_.hosts.size(); ++k)
    for (size_t j = 0; j < groups_.hosts[k].size(); ++j)
      std::memcpy(out + static_cast<size_t>(groups_.hosts[k][j]) * lead_bytes,
                  all.data() + k * leaders_lead + kStatus + j * lead_bytes, lead_bytes);
  std::memcpy(lead_out_.data() + kStatus, leads, world * lead_bytes);
  reply(summed ? kSummed : kNotSummed, summed);
  if (summed) unpack_lead_parts(parts, sum);
  return summed;
}

}  // namespace powersgd::transport
