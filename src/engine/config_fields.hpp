// One list of the Config fields. The fingerprint ranks compare, the checkpoint's
// config record and Config::validate() all walk this list, so a new field is
// added here once and every one of them sees it.
#pragma once

#include "powersgd/reducer.hpp"

namespace powersgd::engine {

// Shared: every rank and a checkpoint must agree on the value (it is in the
// fingerprint and in the checkpoint, in this order). PerRank: may differ between
// ranks (which device a rank computes on) and is neither compared nor saved.
// Agreed: every rank must agree (it is in the fingerprint), but the state it
// leaves means the same under any value, so it is not saved (a resumed run may
// change it): divergence_check_interval changes no result; wire_dtype changes
// the rounding of the factors, whose error the error memory absorbs either way.
enum class FieldScope { Shared, PerRank, Agreed };

// When a configuration uses a Shared field. A field it does not use (the
// adaptive ones without adaptive, `rank` with it, min_compression_rate and
// batch_same_shape with whole_bucket) changes nothing it computes, so neither
// the ranks' fingerprint nor a checkpoint's config check compares it. The
// fields that decide use (adaptive, whole_bucket) are always used.
// WithHighRank: rank_high, used with adaptive or when the schedule-aware
// policy may boost (warmup_steps or lr_boost_steps > 0).
enum class FieldUse { Always, WithoutAdaptive, WithAdaptive, WithoutWholeBucket, WithHighRank };

// What validate() accepts: min <= value <= max (and finite, for floating-point
// fields); `expected` is the phrase its error message ends with.
struct FieldSpec {
  const char* name;
  FieldScope scope;
  double min;
  double max;
  const char* expected;
  // The first checkpoint format version whose config record holds the field
  // (an older file is read with the field at its default; checkpoint.cpp).
  uint32_t since_version = 1;
  FieldUse use = FieldUse::Always;
};

inline bool field_in_use(const FieldSpec& spec, const Config& config) {
  switch (spec.use) {
    case FieldUse::Always: return true;
    case FieldUse::WithoutAdaptive: return !config.adaptive;
    case FieldUse::WithAdaptive: return config.adaptive;
    case FieldUse::WithoutWholeBucket: return !config.whole_bucket;
    case FieldUse::WithHighRank: return config.adaptive || config.warmup_steps > 0 || config.lr_boost_steps > 0;
  }
  return true;
}

inline constexpr double kNoLimit = 1.7976931348623157e308;

// Calls f(spec, field) for every field of `config` (const or not), in the
// checkpoint's order. The field is passed by reference with its own type.
template <typename ConfigT, typename F>
void for_each_config_field(ConfigT& config, F&& f) {
  using enum FieldScope;
  using enum FieldUse;
  f(FieldSpec{"rank", Shared, 1, 64, "1 to 64", 1, WithoutAdaptive}, config.rank);
  f(FieldSpec{"start_iter", Shared, 0, kNoLimit, ">= 0"}, config.start_iter);
  f(FieldSpec{"min_compression_rate", Shared, 0, kNoLimit, "a finite value >= 0", 1, WithoutWholeBucket},
    config.min_compression_rate);
  f(FieldSpec{"error_feedback", Shared, 0, 1, "0 or 1"}, config.error_feedback);
  f(FieldSpec{"warm_start", Shared, 0, 1, "0 or 1"}, config.warm_start);
  // Used as a float: 0, or a normal float (a smaller value rounds to 0 or a subnormal, a larger one to Inf).
  f(FieldSpec{"orthogonalization_epsilon", Shared, 0, 3.4028234663852886e38,
              "0 or a float from 1.1754944e-38 to 3.4028235e38"},
    config.orthogonalization_epsilon);
  f(FieldSpec{"seed", Shared, 0, kNoLimit, "any value"}, config.seed);
  f(FieldSpec{"batch_same_shape", Shared, 0, 1, "0 or 1", 1, WithoutWholeBucket}, config.batch_same_shape);
  f(FieldSpec{"whole_bucket", Shared, 0, 1, "0 or 1"}, config.whole_bucket);
  f(FieldSpec{"device", PerRank, 0, 1, "Cpu (0) or Cuda (1)"}, config.device);
  f(FieldSpec{"device_index", PerRank, 0, kNoLimit, ">= 0"}, config.device_index);
  f(FieldSpec{"adaptive", Shared, 0, 1, "0 or 1", 2}, config.adaptive);
  f(FieldSpec{"rank_low", Shared, 1, 64, "1 to 64", 2, WithAdaptive}, config.rank_low);
  f(FieldSpec{"rank_high", Shared, 1, 64, "1 to 64", 2, WithHighRank}, config.rank_high);
  f(FieldSpec{"adaptive_interval", Shared, 1, kNoLimit, ">= 1", 2, WithAdaptive}, config.adaptive_interval);
  f(FieldSpec{"adaptive_threshold", Shared, 0, kNoLimit, "a finite value >= 0", 2, WithAdaptive},
    config.adaptive_threshold);
  f(FieldSpec{"alternating", Shared, 0, 1, "0 or 1", 2}, config.alternating);
  f(FieldSpec{"divergence_check_interval", Agreed, 0, kNoLimit, ">= 0 (0: off)"}, config.divergence_check_interval);
  f(FieldSpec{"warmup_steps", Shared, 0, kNoLimit, ">= 0", 4}, config.warmup_steps);
  f(FieldSpec{"lr_boost_steps", Shared, 0, kNoLimit, ">= 0", 4}, config.lr_boost_steps);
  f(FieldSpec{"wire_dtype", Agreed, 0, 2, "f32 (0), bf16 (1) or fp16 (2)"}, config.wire_dtype);
}

}  // namespace powersgd::engine
