// Prints the tables of docs/*.md that restate facts of the code, from the code, for check_doc_table.sh
// (tests abi-doc, checkpoint-doc): the documentation cannot drift from the code.
//   doc_tables abi          docs/abi.md's table of the caller-allocated structs: per version its sizeof and
//                           its fields with their offsets (checks the rule of powersgd.h on the way)
//   doc_tables checkpoints  docs/engine.md's table of the checkpoint formats' magic and versions
// Exit 1 (with the reason on stderr) when a struct breaks the rule or a field list here misses a field.
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "powersgd/powersgd.h"

namespace {

struct Field {
  const char* name;
  size_t offset;
  size_t size;
  const char* version;  // the release whose header appended it
};

struct Struct {
  const char* name;
  size_t size;
  size_t align;
  std::vector<Field> fields;  // every field, in order
};

#define PSGD_FIELD(type, field, version) \
  Field { #field, offsetof(type, field), sizeof(type::field), version }

// Every field of every struct the caller allocates (powersgd.h, "ABI"), with the version that appended it.
// A field added to the header and not here fails the completeness check below.
std::vector<Struct> caller_structs() {
  return {
      {"psgd_config", sizeof(psgd_config), alignof(psgd_config),
       {PSGD_FIELD(psgd_config, struct_size, "0.1"), PSGD_FIELD(psgd_config, rank, "0.1"),
        PSGD_FIELD(psgd_config, start_iter, "0.1"), PSGD_FIELD(psgd_config, min_compression_rate, "0.1"),
        PSGD_FIELD(psgd_config, error_feedback, "0.1"), PSGD_FIELD(psgd_config, warm_start, "0.1"),
        PSGD_FIELD(psgd_config, orthogonalization_epsilon, "0.1"), PSGD_FIELD(psgd_config, seed, "0.1"),
        PSGD_FIELD(psgd_config, batch_same_shape, "0.1"), PSGD_FIELD(psgd_config, whole_bucket, "0.1"),
        PSGD_FIELD(psgd_config, device, "0.1"), PSGD_FIELD(psgd_config, device_index, "0.1"),
        PSGD_FIELD(psgd_config, adaptive, "0.2"), PSGD_FIELD(psgd_config, rank_low, "0.2"),
        PSGD_FIELD(psgd_config, rank_high, "0.2"), PSGD_FIELD(psgd_config, adaptive_interval, "0.2"),
        PSGD_FIELD(psgd_config, adaptive_threshold, "0.2"), PSGD_FIELD(psgd_config, alternating, "0.2"),
        PSGD_FIELD(psgd_config, divergence_check_interval, "0.2"), PSGD_FIELD(psgd_config, warmup_steps, "0.2"),
        PSGD_FIELD(psgd_config, lr_boost_steps, "0.2"), PSGD_FIELD(psgd_config, wire_dtype, "0.2")}},
      {"psgd_stats", sizeof(psgd_stats), alignof(psgd_stats),
       {PSGD_FIELD(psgd_stats, struct_size, "0.1"), PSGD_FIELD(psgd_stats, numel_before, "0.1"),
        PSGD_FIELD(psgd_stats, numel_after, "0.1"), PSGD_FIELD(psgd_stats, compression_rate, "0.1"),
        PSGD_FIELD(psgd_stats, bytes_sent, "0.1"), PSGD_FIELD(psgd_stats, relative_error, "0.1"),
        PSGD_FIELD(psgd_stats, last_step_bytes, "0.2")}},
      {"psgd_store_callbacks", sizeof(psgd_store_callbacks), alignof(psgd_store_callbacks),
       {PSGD_FIELD(psgd_store_callbacks, struct_size, "0.2"), PSGD_FIELD(psgd_store_callbacks, user, "0.2"),
        PSGD_FIELD(psgd_store_callbacks, set, "0.2"), PSGD_FIELD(psgd_store_callbacks, get, "0.2"),
        PSGD_FIELD(psgd_store_callbacks, add, "0.2"), PSGD_FIELD(psgd_store_callbacks, wait, "0.2"),
        PSGD_FIELD(psgd_store_callbacks, remove, "0.2")}},
  };
}

size_t round_up(size_t n, size_t align) { return (n + align - 1) / align * align; }

int print_abi() {
  std::printf("| struct | version | `sizeof` (x86-64, AArch64) | fields added (offset) |\n");
  std::printf("| --- | --- | --- | --- |\n");
  for (const Struct& s : caller_structs()) {
    const Field& last = s.fields.back();
    if (round_up(last.offset + last.size, s.align) != s.size) {
      std::fprintf(stderr, "doc_tables: %s is %zu bytes, its fields listed here end at %zu: list the new field\n",
                   s.name, s.size, last.offset + last.size);
      return 1;
    }
    for (size_t begin = 0; begin < s.fields.size();) {
      size_t end = begin;
      std::string fields;
      for (; end < s.fields.size() && std::strcmp(s.fields[end].version, s.fields[begin].version) == 0; ++end) {
        if (end > begin && s.fields[end].offset <= s.fields[end - 1].offset) {
          std::fprintf(stderr, "doc_tables: %s.%s is listed out of order\n", s.name, s.fields[end].name);
          return 1;
        }
        fields += (end > begin ? ", `" : "`") + std::string(s.fields[end].name) + "` (" +
                  std::to_string(s.fields[end].offset) + ")";
      }
      // A version's size: where the next version's fields start (never in this one's tail padding).
      const size_t size = end < s.fields.size() ? s.fields[end].offset : s.size;
      if (end < s.fields.size() && size != round_up(s.fields[end - 1].offset + s.fields[end - 1].size, s.align)) {
        std::fprintf(stderr, "doc_tables: %s's %s fields start at %zu, not at %s's sizeof: the rule of powersgd.h\n",
                     s.name, s.fields[end].version, size, s.fields[begin].version);
        return 1;
      }
      std::printf("| `%s` | %s | %zu | %s |\n", s.name, s.fields[begin].version, size, fields.c_str());
      begin = end;
    }
  }
  return 0;
}

int print_checkpoints() {
  using namespace powersgd::engine;
  static_assert(kJobCheckpointVersion + 1 == kCheckpointVersion, "a job file's payload is per-rank version v + 1's");
  const auto magic = [](const char (&m)[8]) { return std::string(m, sizeof m); };
  std::printf("| checkpoint | magic | version written | versions read | payload |\n");
  std::printf("| --- | --- | --- | --- | --- |\n");
  std::printf("| per-rank (`save`) | `%s` | %u | %u to %u | its own |\n", magic(kCheckpointMagic).c_str(),
              kCheckpointVersion, kCheckpointOldestVersion, kCheckpointVersion);
  std::printf("| job (`save_job`) | `%s` | %u | %u to %u | job version v's is per-rank version v + 1's |\n",
              magic(kJobCheckpointMagic).c_str(), kJobCheckpointVersion, kJobCheckpointOldestVersion,
              kJobCheckpointVersion);
  std::printf("| outer (`OuterOptimizer::save`) | `%s` | %u | %u | start point and outer momentum "
              "(docs/local-steps.md) |\n",
              magic(kOuterCheckpointMagic).c_str(), kOuterCheckpointVersion, kOuterCheckpointVersion);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc == 2 ? argv[1] : "";
  if (what == "abi") return print_abi();
  if (what == "checkpoints") return print_checkpoints();
  std::fprintf(stderr, "usage: doc_tables abi|checkpoints\n");
  return 2;
}
