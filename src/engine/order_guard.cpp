#include "engine/order_guard.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <map>
#include <type_traits>

#include "common/agreed_collectives.hpp"
#include "common/check.hpp"
#include "engine/config_fields.hpp"
#include "engine/fingerprint.hpp"
#include "engine/half.hpp"
#include "engine/rank_reports.hpp"

namespace powersgd::engine {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL, kP3 = 0x165667B19E3779F9ULL;
constexpr uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t load_word(const unsigned char* p) {
  uint64_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// A reduce_all's identity: this bit and the number of buckets (a single
// bucket's identity is its index).
constexpr uint64_t kAllBuckets = uint64_t{1} << 63;

// The values a rank reports on the error path, in this order; all but Loaded
// go into the announce's hash.
enum Value : size_t { Step, Identity, Numel, FirstCount, ConfigFp, Layout, WarmBuckets, Warm, Check, CheckStep,
                      Note, Loaded, kValueCount };
static_assert(kValueCount <= RankReport::kValues);

std::string what_of(const std::vector<uint64_t>& v) {
  const uint64_t id = v[Identity];
  if ((id & kAllBuckets) != 0)
    return detail::concat("buckets 0..", (id & ~kAllBuckets) - 1, " (reduce_all, ", v[Numel], " floats)");
  return detail::concat("bucket ", id, " (", v[Numel], " floats)");
}

std::string ranks_text(const std::vector<size_t>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return text;
}

// "%.17g": doubles that differ print differently.
template <typename T>
std::string value_text(const T& value) {
  if constexpr (std::is_floating_point_v<T>) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.17g", static_cast<double>(value));
    return text;
  } else if constexpr (std::is_same_v<T, WireDType>) {
    return to_string(value);
  } else if constexpr (std::is_enum_v<T>) {
    return std::to_string(static_cast<int>(value));
  } else {
    return detail::concat(+value);
  }
}

// Key and value lines: the compared config fields, bucket `index`'s tensors.
std::vector<std::pair<std::string, std::string>> describe(const Config& config, int index,
                                                          std::span<const Shape> shapes) {
  std::vector<std::pair<std::string, std::string>> lines;
  for_each_config_field(config, [&](const FieldSpec& spec, const auto& value) {
    if (spec.scope != FieldScope::PerRank) lines.emplace_back(detail::concat("config.", spec.name), value_text(value));
  });
  lines.emplace_back(detail::concat("bucket ", index, " tensors:"), std::to_string(shapes.size()));
  for (size_t t = 0; t < shapes.size(); ++t) {
    std::string dims = "[";
    for (size_t d = 0; d < shapes[t].size(); ++d) dims += (d == 0 ? "" : ",") + std::to_string(shapes[t][d]);
    lines.emplace_back(detail::concat("bucket ", index, " tensor ", t, ":"), dims + "]");
  }
  return lines;
}

}  // namespace

void raise_layout_mismatch(Communicator& comm, const Config& config, int index, std::span<const Shape> shapes,
                           const std::vector<RankReport>& fingerprints) {
  const auto mine = describe(config, index, shapes);
  std::string text;
  if (comm.rank() == 0)
    for (const auto& [key, value] : mine) text += key + '\t' + value + '\n';
  uint64_t size = text.size();
  detail::broadcast_agreed_async(comm, &size, sizeof(size), 0).wait();
  text.resize(static_cast<size_t>(size));
  detail::broadcast_agreed_async(comm, text.data(), text.size(), 0).wait();  // of the size broadcast
  std::map<std::string, std::string> root;
  for (size_t at = 0; at < text.size();) {
    const size_t tab = text.find('\t', at), end = text.find('\n', at);
    root[text.substr(at, tab - at)] = text.substr(tab + 1, end - tab - 1);
    at = end + 1;
  }
  std::string difference;
  for (const auto& [key, value] : mine) {
    const auto theirs = root.find(key);
    const std::string root_value = theirs == root.end() ? "none" : theirs->second;
    if (root_value == value) continue;
    difference = detail::concat(key, " ", value, " on rank ", comm.rank(), ", ", root_value, " on rank 0");
    break;
  }
  if (difference.empty() && root.size() != mine.size())
    difference = detail::concat("bucket ", index, " has ", shapes.size(), " tensors on rank ", comm.rank(),
                                ", more on rank 0");
  const auto reports = gather_reports(
      comm, difference.empty() ? RankReport{} : report_failure(std::make_exception_ptr(MismatchError(difference))));
  std::vector<size_t> ranks;
  for (size_t k = 0; k < reports.size(); ++k)
    if (reports[k].failed()) ranks.push_back(k);
  std::string what = detail::concat("layout of buckets 0..", index, " or reducer configuration differs between ranks");
  if (ranks.empty()) {  // a difference the description does not show: the fingerprints
    for (size_t k = 1; k < fingerprints.size(); ++k)
      if (fingerprints[k].values[0] != fingerprints[0].values[0])
        PSGD_THROW(MismatchError, what, ": rank ", k, " has fingerprint ", std::hex, fingerprints[k].values[0],
                   ", rank 0 has ", fingerprints[0].values[0]);
    PSGD_THROW(InternalError, what, ", yet no rank's fingerprint differs");
  }
  PSGD_THROW(MismatchError, what, ": ", reports[ranks[0]].reason_text(),
             ranks.size() > 1 ? detail::concat(" (and ", ranks.size() - 1, " other rank(s) differ)") : std::string());
}

uint64_t hash_floats(const float* x, size_t count, uint64_t seed) {
  // XXH3's accumulate loop over 8-byte words, eight lanes of 64-byte stripes:
  // 32 x 32 -> 64 bit products the compiler vectorizes, so it runs at memory
  // speed; integer arithmetic, so every vector width gives the same value.
  // Each word also enters its neighbour lane by addition, so no bit goes unseen.
  constexpr size_t kLanes = 8, kStripesPerScramble = 16;
  static constexpr uint64_t kKey[kLanes] = {0xBE4BA423396CFEB8ULL, 0x1CAD21F72C81017CULL, 0xDB979083E96DD4DEULL,
                                            0x1F67B3B7A4A44072ULL, 0x78E5C0CC4EE679CBULL, 0x2172FFCC7DD05A82ULL,
                                            0x8E2443F7744608B8ULL, 0x4C263A81E69035E0ULL};
  const auto* bytes = reinterpret_cast<const unsigned char*>(x);
  const size_t words = count / 2;
  uint64_t acc[kLanes];
  for (size_t lane = 0; lane < kLanes; ++lane) acc[lane] = kKey[lane] + seed;
  size_t i = 0, stripes = 0;
  for (; i + kLanes <= words; i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) {
      const uint64_t w = load_word(bytes + 8 * (i + lane));
      const uint64_t keyed = w ^ kKey[lane];
      acc[lane ^ 1] += w;
      acc[lane] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
    }
    if (++stripes == kStripesPerScramble) {
      stripes = 0;
      for (size_t lane = 0; lane < kLanes; ++lane)
        acc[lane] = (acc[lane] ^ (acc[lane] >> 47) ^ kKey[lane]) * 0x9E3779B1ULL;
    }
  }
  uint64_t h = seed + count * kP1;
  for (size_t lane = 0; lane < kLanes; ++lane) h = rotl(h ^ (rotl(acc[lane] * kP2, 31) * kP1), 27) * kP1 + kP3;
  for (; i < words; ++i) h = rotl(h ^ (rotl(load_word(bytes + 8 * i) * kP2, 31) * kP1), 27) * kP1 + kP3;
  if (count % 2 != 0) {
    uint32_t last;
    std::memcpy(&last, bytes + 8 * words, sizeof(last));
    h = rotl(h ^ (uint64_t{last} * kP1), 23) * kP2 + kP3;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  return h ^ (h >> 32);
}

void encode_agreement(uint64_t value, double* out) {
  for (size_t k = 0; k < kChunks; ++k) {
    const auto x = static_cast<double>((value >> (16 * k)) & 0xFFFF);
    out[2 * k] = x;
    out[2 * k + 1] = x * x;
  }
}

bool all_agree(const double* sums, int world) {
  // Sums of n < 2^12 chunks below 2^16 (squares below 2^32) are exact in double;
  // both products stay below 2^56.
  for (size_t k = 0; k < kChunks; ++k) {
    const auto sum = static_cast<uint64_t>(sums[2 * k]);
    const auto squares = static_cast<uint64_t>(sums[2 * k + 1]);
    if (static_cast<uint64_t>(world) * squares != sum * sum) return false;
  }
  return true;
}

uint64_t OrderGuard::first_collective_count(const Reduction& r) const {
  const BucketState& first = *buckets_[static_cast<size_t>(r.buckets[0])];
  if (!r.compressed) return static_cast<uint64_t>(first.plan.numel + 1);  // one collective per bucket
  uint64_t count = 0;  // one collective for all of the reduction's buckets: [packed | flag | factor] each
  for (int b : r.buckets) {
    const BucketState& s = *buckets_[static_cast<size_t>(b)];
    const bool q_half = in_q_half(config_, s);
    count += static_cast<uint64_t>(s.plan.float32_part_numel() + (q_half ? s.plan.q_numel : s.plan.p_numel));
  }
  return count;
}

void add_warm_state(Fnv& h, const BucketState& s) {
  h.add(s.q_initialized);
  h.add(s.draws);
  h.add(s.current_rank);  // the adaptive level and the alternating half decide the sizes too
  h.add(s.compressed_steps);
  h.add(s.boost_left);  // the rank policy's state decides the next levels
}

OrderGuard::OrderGuard(const Config& config, Communicator& comm, compute::Backend& backend,
                       const std::vector<std::unique_ptr<BucketState>>& buckets, const Arenas& arenas, Stats& stats)
    : config_(config), comm_(comm), be_(backend), buckets_(buckets), arenas_(arenas), stats_(stats) {
  // The same on every rank (the communicator's settings are agreed): so is which collective announces.
  const size_t capacity = comm.size() > 1 ? comm.lead_exchange_capacity() : 0;
  if (capacity >= kAnnounceBytes) {
    lead_capacity_ = capacity;
    leads_.assign(static_cast<size_t>(comm.size()) * kMaxFused * kBlock, 0.0);
  }
}

CarriedCounts OrderGuard::carried_counts(const Reduction& r) const {
  if (config_.wire_dtype == WireDType::Float32) return {first_collective_count(r), 0};
  CarriedCounts counts{StepRunner::float32_count(buckets_, r.buckets),
                       StepRunner::factor_count(config_, buckets_, r.buckets)};
  const DataType half = wire_type(config_.wire_dtype);
  const std::array<LeadPart, 2> parts{LeadPart{nullptr, counts.floats, DataType::Float32},
                                      LeadPart{nullptr, counts.halves, half}};
  if (kAnnounceBytes + lead_parts_bytes(parts) > lead_capacity_ ||
      !comm_.sums_in_rank_order(static_cast<size_t>(counts.halves), half))
    counts.halves = 0;
  return counts;
}

bool OrderGuard::can_carry(const Reduction& r) const {
  if (lead_capacity_ == 0 || !r.compressed || r.poisoned) return false;
  const uint64_t count = carried_counts(r).floats;
  return count > 0 && kAnnounceBytes + count * sizeof(float) <= lead_capacity_ &&
         comm_.sums_in_rank_order(static_cast<size_t>(count), DataType::Float32);
}

void OrderGuard::begin(const Reduction& r, uint64_t layout, bool loaded,
                       std::span<const Reduction* const> proposals, bool carry) {
  PSGD_ASSERT(proposals.size() < kMaxFused, proposals.size(), " proposals, at most ", kMaxFused - 1);
  PSGD_ASSERT(!carry || can_carry(r), "an announce carries a first collective it cannot");
  first_summed_ = false;
  carried_halves_ = false;
  carried_overwritten_ = false;
  pending_.resize(buckets_.size());
  std::vector<uint64_t>& mine = mine_;
  mine.assign(kValueCount, 0);
  loaded_ = loaded;
  carried_.clear();
  proposal_carried_.assign(proposals.size(), {});
  if (!r.poisoned) {
    // What decides the sizes and the meaning of the data collectives (the state
    // check_state compared once, now before every reduction).
    Fnv warm;
    uint64_t warm_buckets = 0, numel = 0, check = 0;
    int64_t check_step = -1;
    for (const auto& s : buckets_) {
      warm_buckets += s->q_initialized ? 1 : 0;
      add_warm_state(warm, *s);
    }
    uint64_t notes = 0;
    for (int b : r.buckets) notes += buckets_[static_cast<size_t>(b)]->note_pending ? 1 : 0;
    identity_hash(r, carried_, numel, check_step, check);
    mine[Step] = static_cast<uint64_t>(r.iteration);
    mine[Identity] = r.buckets.size() == 1 ? static_cast<uint64_t>(r.buckets[0]) : kAllBuckets | r.buckets.size();
    mine[Numel] = numel;
    mine[FirstCount] = first_collective_count(r);
    mine[ConfigFp] = config_fingerprint(config_);
    mine[Layout] = layout;
    mine[WarmBuckets] = warm_buckets;
    mine[Warm] = warm.value();
    mine[Check] = check;
    mine[CheckStep] = static_cast<uint64_t>(check_step + 1);
    mine[Note] = notes;
    mine[Loaded] = loaded ? 1 : 0;
  }
  if (comm_.size() == 1) return;  // nobody to disagree with
  std::fill(std::begin(sums_), std::end(sums_), 0.0);
  Fnv all;
  for (size_t v = 0; v < Loaded; ++v) all.add(mine[v]);
  encode_agreement(all.value(), sums_);
  sums_[2 * kChunks] = r.poisoned ? 1.0 : 0.0;  // ranks whose call failed locally
  // A proposal is compared on its own identity: the state every announce covers
  // (configuration, layout, every bucket's warm state) is in block 0 already.
  for (size_t j = 0; j < proposals.size() && !r.poisoned; ++j) {
    uint64_t numel = 0, check = 0;
    int64_t check_step = -1;
    const uint64_t identity = identity_hash(*proposals[j], proposal_carried_[j], numel, check_step, check);
    double* block = sums_ + (j + 1) * kBlock;
    encode_agreement(identity, block);
    block[2 * kChunks] = 1.0;  // proposed by this rank
  }
  if (carry) {
    deferred_ = true;  // carry() sends it
  } else if (lead_capacity_ > 0) {
    announced_ = send_lead({});
  } else {
    announced_ = detail::allreduce_agreed_async(comm_, sums_, kMaxFused * kBlock, DataType::Float64);
  }
}

void OrderGuard::carry(std::span<float> floats, std::span<uint16_t> halves) {
  PSGD_ASSERT(deferred_, "carry() without begin(carry)");
  const std::array<LeadPart, 2> parts{LeadPart{floats.data(), floats.size(), DataType::Float32},
                                      LeadPart{halves.data(), halves.size(), wire_type(config_.wire_dtype)}};
  announced_ = send_lead(parts);  // an empty second part is none (lead_parts_bytes)
  carried_halves_ = !halves.empty();
  deferred_ = false;  // only once sent: else settle() sends it
}

Work OrderGuard::send_lead(std::span<const LeadPart> parts) {
  return comm_.lead_exchange_async(sums_, leads_.data(), kAnnounceBytes, parts, &first_summed_);
}

uint64_t OrderGuard::identity_hash(const Reduction& r, std::vector<int>& carried, uint64_t& numel,
                                   int64_t& check_step, uint64_t& check) const {
  Fnv pending;
  for (int b : r.buckets) {
    numel += static_cast<uint64_t>(buckets_[static_cast<size_t>(b)]->plan.numel);
    const Pending& p = pending_[static_cast<size_t>(b)];
    if (p.step < 0) continue;
    pending.add(b);
    pending.add(p.hash);
    check_step = std::max(check_step, p.step);
    carried.push_back(b);  // pending until compared (compared())
  }
  check = check_step >= 0 ? pending.value() : 0;
  Fnv h;
  h.add(static_cast<uint64_t>(r.iteration));
  for (int b : r.buckets) h.add(static_cast<uint64_t>(b));
  h.add(numel);
  h.add(first_collective_count(r));
  h.add(check);
  h.add(static_cast<uint64_t>(check_step + 1));
  return h.value();
}

size_t OrderGuard::finish(const Reduction& r) {
  if (comm_.size() == 1) {
    if (r.poisoned) std::rethrow_exception(r.poisoned);
    return 1;
  }
  const auto start = Clock::now();
  Work announced = std::move(announced_);
  announced_ = Work();
  announced.wait();
  stats_.guard_seconds += seconds_since(start);
  carried_overwritten_ = first_summed_;
  if (lead_capacity_ > 0) {
    // The leads in rank order: sums of small integers, exact, so the allreduce's values on every rank.
    constexpr size_t kValues = kMaxFused * kBlock;
    std::fill(std::begin(sums_), std::end(sums_), 0.0);
    for (size_t rank = 0; rank < static_cast<size_t>(comm_.size()); ++rank)
      for (size_t v = 0; v < kValues; ++v) sums_[v] += leads_[rank * kValues + v];
  }
  if (sums_[2 * kChunks] == 0.0 && all_agree(sums_, comm_.size())) {
    compared();
    // The proposals every rank made alike, as a prefix: the sums are the same on every rank.
    size_t fused = 1;
    const auto world = static_cast<double>(comm_.size());
    for (size_t j = 1; j < kMaxFused; ++j) {
      const double* block = sums_ + j * kBlock;
      if (block[2 * kChunks] != world || !all_agree(block, comm_.size())) break;
      for (int b : proposal_carried_[j - 1]) pending_[static_cast<size_t>(b)] = Pending{};
      fused = j + 1;
    }
    // Carried sums of equal sizes are of the same reductions only where no rank proposed more than the agreed
    // (block `fused` proposed by none): each rank carried the reduction and the agreed proposals, fused.
    if (fused < kMaxFused && sums_[fused * kBlock + 2 * kChunks] != 0.0) first_summed_ = false;
    return fused;
  }
  raise(r, mine_, loaded_);
}

void OrderGuard::compared() {
  for (int b : carried_) pending_[static_cast<size_t>(b)] = Pending{};
  carried_.clear();
}

void OrderGuard::settle() noexcept {
  if (deferred_) {
    // Begun with carry, never sent (nothing throws in between today): sent alone, flagged as this rank's local
    // failure, which the other ranks then gather the reports of (raise): this rank takes part with the error
    // being handled, so every rank fails this reduction with it and the ranks stay in step.
    deferred_ = false;
    sums_[2 * kChunks] = 1.0;
    std::exception_ptr error = std::current_exception();
    if (!error) error = std::make_exception_ptr(InternalError("the announce was begun and not sent"));
    try {
      send_lead({}).wait();
      gather_reports(comm_, report_failure(error));
    } catch (...) {
    }
    return;
  }
  if (!announced_.valid()) return;
  try {
    announced_.wait();  // sums_ is the collective's buffer until it completed
  } catch (...) {
  }
  announced_ = Work();
}


void OrderGuard::raise(const Reduction& r, const std::vector<uint64_t>& mine, bool loaded) {
  const auto start = Clock::now();
  RankReport report;
  if (r.poisoned) {
    report = report_failure(r.poisoned);
  } else {
    std::copy(mine.begin(), mine.end(), report.values.begin());
  }
  const std::vector<RankReport> reports = gather_reports(comm_, report);
  stats_.guard_seconds += seconds_since(start);
  throw_if_any_failed(reports, r.poisoned, detail::concat("step ", r.iteration, ", ", what_of(mine)),
                      "nothing reduced or changed on any rank");
  const auto values = [&](size_t rank) {
    return std::vector<uint64_t>(reports[rank].values.begin(), reports[rank].values.begin() + kValueCount);
  };
  const std::vector<uint64_t> root = values(0);
  const auto differs = [&](size_t rank, std::initializer_list<Value> fields) {
    const std::vector<uint64_t> v = values(rank);
    return std::any_of(fields.begin(), fields.end(), [&](Value f) { return v[f] != root[f]; });
  };
  // The ranks that differ from rank 0 in `fields`.
  const auto differing = [&](std::initializer_list<Value> fields) {
    std::vector<size_t> ranks;
    for (size_t k = 1; k < reports.size(); ++k)
      if (differs(k, fields)) ranks.push_back(k);
    return ranks;
  };
  bool any_loaded = loaded;
  for (size_t k = 0; k < reports.size(); ++k) any_loaded = any_loaded || values(k)[Loaded] != 0;
  const auto step = [&](uint64_t v) {
    const auto iteration = static_cast<int64_t>(v);
    return detail::concat(iteration, iteration >= config_.start_iter ? " (compressed)" : " (uncompressed)");
  };
  const auto others = [](const std::vector<size_t>& ranks) {
    return ranks.size() > 1 ? detail::concat(" (and ", ranks.size() - 1, " other rank(s))") : std::string();
  };

  if (const auto ranks = differing({ConfigFp, Layout}); !ranks.empty())
    PSGD_THROW(MismatchError, "step ", r.iteration, ": rank ", ranks[0], others(ranks),
               " reduces with another configuration or bucket layout than rank 0 (fingerprints ", std::hex,
               values(ranks[0])[ConfigFp], "/", values(ranks[0])[Layout], " against ", root[ConfigFp], "/",
               root[Layout], std::dec, "); nothing reduced or changed on any rank");

  const auto state_ranks = differing({Step, WarmBuckets, Warm});
  if (!state_ranks.empty() && any_loaded) {
    // Ranks resumed from checkpoints of different steps (check_state's wording).
    const size_t k = state_ranks[0];
    const std::vector<uint64_t> v = values(k);
    std::string what;
    auto add = [&](const std::string& text) { what += (what.empty() ? "" : "; ") + text; };
    if (v[Step] != root[Step]) add(detail::concat("step ", step(v[Step]), " against ", step(root[Step])));
    if (v[WarmBuckets] != root[WarmBuckets] || v[Warm] != root[Warm])
      add(detail::concat("warm-start state (a warm-start Q in ", v[WarmBuckets], " of ", buckets_.size(),
                         " buckets against ", root[WarmBuckets], ", or other generator draws)"));
    if (v[Identity] != root[Identity])
      add("the buckets of the first reduction (reduce them in the same order)");
    PSGD_THROW(MismatchError, "ranks resumed from inconsistent state: rank ", k, " differs from rank 0 in ", what,
               ". Nothing was reduced or changed; load checkpoints of one step on every rank (load is due on "
               "every rank before the next reduce), then reduce again");
  }
  if (const auto ranks = differing({Step}); !ranks.empty()) {
    const std::vector<uint64_t> v = values(ranks[0]);
    PSGD_THROW(MismatchError, "ranks are at different steps: rank ", ranks[0], others(ranks), " reduces ",
               what_of(v), " of step ", step(v[Step]), " where rank 0 reduces ", what_of(root), " of step ",
               step(root[Step]), "; nothing reduced or changed on any rank. A rank skipped or repeated a bucket: "
               "every rank reduces every bucket once per step, in the same order");
  }
  if (const auto ranks = differing({Identity, Numel}); !ranks.empty()) {
    const std::vector<uint64_t> v = values(ranks[0]);
    PSGD_THROW(MismatchError, "step ", r.iteration, ": rank ", ranks[0], others(ranks), " reduces ", what_of(v),
               " where rank 0 reduces ", what_of(root),
               "; nothing reduced or changed on any rank. Reduce the buckets in the same order on every rank (from "
               "one thread)");
  }
  if (const auto ranks = differing({FirstCount}); !ranks.empty()) {
    // The same buckets, another size of the first collective: the bucket's rank level (its P) differs, a state
    // apart (a level switch that failed on one rank), not an order.
    const std::vector<uint64_t> v = values(ranks[0]);
    PSGD_THROW(MismatchError, "step ", r.iteration, ", ", what_of(root), ": rank ", ranks[0], others(ranks),
               " compresses at another rank than rank 0 (its first collective has ", v[FirstCount], " floats against ",
               root[FirstCount], "); nothing reduced or changed on any rank. Restore every rank from one checkpoint");
  }
  if (const auto ranks = differing({Note}); !ranks.empty()) {
    const bool noted = values(ranks[0])[Note] != 0;
    PSGD_THROW(MismatchError, "step ", r.iteration, ", ", what_of(root), ": ", noted ? "rank " : "rank 0 ",
               noted ? std::to_string(ranks[0]) : std::string(), noted ? others(ranks) : std::string(),
               " noted a learning-rate change (note_lr_change) that ", noted ? "rank 0" : "rank ",
               noted ? std::string() : std::to_string(ranks[0]), noted ? std::string() : others(ranks),
               " did not; nothing reduced or changed on any rank, the note still pending. Note it on every rank "
               "before the same step (or load a checkpoint on every rank)");
  }
  if (!state_ranks.empty()) {
    const std::vector<uint64_t> v = values(state_ranks[0]);
    PSGD_THROW(MismatchError, "step ", r.iteration, ": rank ", state_ranks[0], others(state_ranks),
               " has another warm-start state than rank 0 (a warm-start Q in ", v[WarmBuckets], " of ",
               buckets_.size(), " buckets against ", root[WarmBuckets],
               ", or other generator draws); nothing reduced or changed on any rank");
  }
  if (!differing({Check, CheckStep}).empty()) {
    // Group the ranks by hash: with three or more, the odd one out is the replica that drifted.
    std::map<uint64_t, std::vector<size_t>> groups;
    for (size_t k = 0; k < reports.size(); ++k) groups[values(k)[Check]].push_back(k);
    std::vector<std::vector<size_t>> ordered;
    for (auto& [hash, ranks] : groups) ordered.push_back(ranks);
    std::sort(ordered.begin(), ordered.end(),
              [](const auto& a, const auto& b) { return a.size() != b.size() ? a.size() < b.size() : a < b; });
    const auto checked_step = static_cast<int64_t>(root[CheckStep]) - 1;
    const std::string where = detail::concat("replicas diverged in step ", checked_step, ", ", what_of(root), ": ");
    const std::string advice =
        "; the ranks no longer apply the same update. Restore every rank from one checkpoint (docs/engine.md, "
        "\"Order guard and divergence detector\")";
    compared();  // reported once
    // With three or more ranks, a group smaller than every other is the replica that drifted.
    if (ordered.size() >= 2 && ordered[0].size() < ordered[1].size()) {
      std::vector<size_t> rest;
      for (size_t g = 1; g < ordered.size(); ++g) rest.insert(rest.end(), ordered[g].begin(), ordered[g].end());
      std::sort(rest.begin(), rest.end());
      PSGD_THROW(MismatchError, where, ranks_text(ordered[0]), " computed another output or warm-start P, Q than ",
                 ranks_text(rest), advice);
    }
    std::string split;
    for (const auto& ranks : ordered) split += (split.empty() ? "" : " / ") + ranks_text(ranks);
    PSGD_THROW(MismatchError, where, "the ranks' outputs or warm-start P, Q differ (ranks with equal hashes: ", split,
               ")", advice);
  }
  PSGD_THROW(InternalError, "step ", r.iteration, ": the order guard's sums disagreed, but every rank reported the "
             "same values");
}

void OrderGuard::after_success(const Reduction& r) {
  const int64_t interval = config_.divergence_check_interval;
  if (interval == 0 || comm_.size() == 1 || (r.iteration + 1) % interval != 0) return;
  const auto start = Clock::now();
  pending_.resize(buckets_.size());
  const auto hash_device = [&](const float* x, size_t count, uint64_t seed) {
    if (arenas_.host_accessible) return hash_floats(x, count, seed);
    host_scratch_.resize(count);
    be_.copy_to_host(host_scratch_.data(), x, count);
    return hash_floats(host_scratch_.data(), count, seed);
  };
  for (size_t i = 0; i < r.buckets.size(); ++i) {
    const int b = r.buckets[i];
    const BucketState& s = *buckets_[static_cast<size_t>(b)];
    uint64_t h = hash_device(r.data[i], static_cast<size_t>(s.plan.numel), 0);
    // P and Q exist (and are identical on every rank) once the bucket was compressed.
    if (s.q_initialized) {
      h = hash_device(arenas_.p_state.data() + s.p_offset, static_cast<size_t>(s.plan.p_numel), h);
      h = hash_device(arenas_.q_state.data() + s.q_offset, static_cast<size_t>(s.plan.q_numel), h);
    }
    pending_[static_cast<size_t>(b)] = Pending{h, r.iteration};
  }
  stats_.check_seconds += seconds_since(start);
}

}  // namespace powersgd::engine
