// Config::validate: every field against the range config_fields.hpp gives it.
#include <cmath>
#include <type_traits>

#include "common/check.hpp"
#include "engine/config_fields.hpp"

namespace powersgd {

void Config::validate() const {
  engine::for_each_config_field(*this, [](const engine::FieldSpec& spec, const auto& value) {
    using T = std::decay_t<decltype(value)>;
    if constexpr (!std::is_same_v<T, bool>) {  // a bool holds only valid values
      const auto number = [&] {
        if constexpr (std::is_enum_v<T>)
          return static_cast<std::underlying_type_t<T>>(value);
        else
          return value;
      }();
      const auto real = static_cast<double>(number);
      bool valid = real >= spec.min && real <= spec.max;
      if constexpr (std::is_floating_point_v<T>) valid = valid && std::isfinite(value);
      PSGD_REQUIRE(valid, InvalidArgumentError, "config.", spec.name, " = ", number, ": expected ", spec.expected);
    }
  });
  PSGD_REQUIRE(orthogonalization_epsilon == 0 || orthogonalization_epsilon >= 1.1754943508222875e-38,
               InvalidArgumentError, "config.orthogonalization_epsilon = ", orthogonalization_epsilon,
               ": expected 0 or a float from 1.1754944e-38 to 3.4028235e38");
  PSGD_REQUIRE(rank_low <= rank_high, InvalidArgumentError, "config.rank_low = ", rank_low, " > config.rank_high = ",
               rank_high, ": expected rank_low <= rank_high");
  // Each alternating half starts from the other half's averaged factor: that is the warm start.
  PSGD_REQUIRE(!alternating || warm_start, InvalidArgumentError,
               "config.alternating = 1 with config.warm_start = 0: alternating needs warm_start = 1 (each step "
               "starts from the previous step's averaged factor)");
  // The 16-bit wire converts on the host; the CUDA backend keeps the factors on the device.
  PSGD_REQUIRE(device == Device::Cpu || wire_dtype == WireDType::Float32, UnsupportedError,
               "config.wire_dtype = ", to_string(wire_dtype),
               " with config.device = Cuda: 16-bit factors on the wire are CPU-only; use wire_dtype f32 on CUDA");
}

const char* to_string(WireDType type) {
  switch (type) {
    case WireDType::Float32: return "f32";
    case WireDType::BFloat16: return "bf16";
    case WireDType::Float16: return "fp16";
  }
  return "unknown";
}

}  // namespace powersgd
