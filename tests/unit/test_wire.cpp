// engine/half: the 16-bit wire types' conversions (round to nearest even,
// NaN/Inf, denormals, overflow), against hand-computed values and, where the
// compiler has _Float16, against its conversions over a sweep of float32.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <stdlib.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "engine/half.hpp"
#include "c_comm_of_one.hpp"
#include "powersgd/powersgd.h"

using namespace powersgd;
using namespace powersgd::engine;

namespace {
float from_bits(uint32_t bits) { return std::bit_cast<float>(bits); }
constexpr float kInf = std::numeric_limits<float>::infinity();
}  // namespace

TEST_CASE("bfloat16: round to nearest even on the dropped half") {
  CHECK(to_bfloat16(1.0f) == 0x3F80);
  CHECK(to_bfloat16(-2.0f) == 0xC000);
  // 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7: to even, down.
  CHECK(to_bfloat16(from_bits(0x3F808000)) == 0x3F80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6: to even, up.
  CHECK(to_bfloat16(from_bits(0x3F818000)) == 0x3F82);
  // Just above and below the halfway point.
  CHECK(to_bfloat16(from_bits(0x3F808001)) == 0x3F81);
  CHECK(to_bfloat16(from_bits(0x3F807FFF)) == 0x3F80);
  // A carry through the fraction into the exponent: 2 - 2^-9 rounds to 2.
  CHECK(to_bfloat16(from_bits(0x3FFFFF00)) == 0x4000);
  // Every bfloat16 survives the round trip.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = from_bfloat16(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      CHECK(std::isnan(from_bfloat16(to_bfloat16(f))));
    } else {
      REQUIRE(to_bfloat16(f) == b);
    }
  }
}

TEST_CASE("bfloat16: NaN, Inf, overflow, denormals, signed zero") {
  CHECK(to_bfloat16(kInf) == 0x7F80);
  CHECK(to_bfloat16(-kInf) == 0xFF80);
  // The largest float rounds past the largest bfloat16 (0x7F7F): Inf, as IEEE rounding says.
  CHECK(to_bfloat16(std::numeric_limits<float>::max()) == 0x7F80);
  CHECK(to_bfloat16(from_bits(0x7F7F7FFF)) == 0x7F7F);
  // A NaN whose payload lies only in the dropped bits stays a NaN (would truncate to Inf), sign kept.
  CHECK(std::isnan(from_bfloat16(to_bfloat16(from_bits(0x7F800001)))));
  CHECK((to_bfloat16(from_bits(0xFF800001)) & 0x8000) != 0);
  CHECK(std::isnan(from_bfloat16(to_bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  // Denormals are rounded, not flushed: the smallest float denormal rounds to 0, a larger one keeps its bits.
  CHECK(to_bfloat16(from_bits(0x00000001)) == 0x0000);
  CHECK(to_bfloat16(from_bits(0x00010000)) == 0x0001);
  CHECK(to_bfloat16(from_bits(0x00018000)) == 0x0002);  // tie, to even
  CHECK(from_bfloat16(0x0001) == from_bits(0x00010000));
  CHECK(to_bfloat16(-0.0f) == 0x8000);
}

TEST_CASE("float16: round to nearest even, range, denormals") {
  CHECK(to_float16(1.0f) == 0x3C00);
  CHECK(to_float16(-2.0f) == 0xC000);
  CHECK(to_float16(65504.0f) == 0x7BFF);
  // Halfway between 1 and 1 + 2^-10: to even (1); between 1 + 2^-10 and 1 + 2^-9: up to even.
  CHECK(to_float16(1.0f + 0x1p-11f) == 0x3C00);
  CHECK(to_float16(1.0f + 3 * 0x1p-11f) == 0x3C02);
  CHECK(to_float16(std::nextafter(1.0f + 0x1p-11f, 2.0f)) == 0x3C01);
  // 65520 is halfway between 65504 and 65536 (not representable): to even, Inf. Just below: 65504.
  CHECK(to_float16(65520.0f) == 0x7C00);
  CHECK(to_float16(std::nextafter(65520.0f, 0.0f)) == 0x7BFF);
  CHECK(to_float16(-1e6f) == 0xFC00);
  CHECK(to_float16(kInf) == 0x7C00);
  CHECK(to_float16(-kInf) == 0xFC00);
  const uint16_t nan = to_float16(std::numeric_limits<float>::quiet_NaN());
  CHECK((nan & 0x7C00) == 0x7C00);
  CHECK((nan & 0x03FF) != 0);
  CHECK(std::isnan(from_float16(to_float16(from_bits(0x7F800001)))));  // payload only in the dropped bits
  CHECK((to_float16(from_bits(0xFFC00000)) & 0x8000) != 0);
  // Denormals: 2^-24 is the smallest; 2^-25 is the tie with zero (to even: 0); just above it rounds up.
  CHECK(to_float16(0x1p-24f) == 0x0001);
  CHECK(to_float16(0x1p-25f) == 0x0000);
  CHECK(to_float16(std::nextafter(0x1p-25f, 1.0f)) == 0x0001);
  CHECK(to_float16(3 * 0x1p-25f) == 0x0002);  // 1.5 units: tie, to even (2)
  CHECK(to_float16(5 * 0x1p-25f) == 0x0002);  // 2.5 units: tie, to even (2)
  CHECK(to_float16(-0x1p-24f) == 0x8001);
  CHECK(to_float16(0x1p-14f) == 0x0400);                       // smallest normal
  CHECK(to_float16(0x1p-14f - 0x1p-26f) == 0x0400);            // rounds up into it from the denormals
  CHECK(to_float16(1e-30f) == 0x0000);
  CHECK(to_float16(-0.0f) == 0x8000);
  CHECK(from_float16(0x0001) == 0x1p-24f);
  CHECK(from_float16(0x03FF) == 1023 * 0x1p-24f);
  CHECK(from_float16(0x7C00) == kInf);
  CHECK(std::isnan(from_float16(0x7E00)));
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = from_float16(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      CHECK(std::isnan(from_float16(to_float16(f))));
    } else {
      REQUIRE(to_float16(f) == b);
    }
  }
}

#ifdef __FLT16_MAX__
TEST_CASE("float16 and bfloat16 agree with the compiler's conversions over a float32 sweep") {
  // Every 997th bit pattern: all exponents, many fractions, both signs.
  for (uint64_t b = 0; b <= 0xFFFFFFFFu; b += 997) {
    const float f = from_bits(static_cast<uint32_t>(b));
    if (std::isnan(f)) continue;
    const auto h = static_cast<_Float16>(f);
    REQUIRE(to_float16(f) == std::bit_cast<uint16_t>(h));
    REQUIRE(from_float16(std::bit_cast<uint16_t>(h)) == static_cast<float>(h));
#ifdef __BFLT16_MAX__
    REQUIRE(to_bfloat16(f) == std::bit_cast<uint16_t>(static_cast<__bf16>(f)));
#endif
  }
}
#endif

TEST_CASE("encode and decode: the bulk forms use the per-element conversions") {
  const std::vector<float> in{1.0f, -0.5f, 1e-6f, 3e38f, 70000.0f, -0.0f};
  for (WireDType type : {WireDType::BFloat16, WireDType::Float16}) {
    std::vector<uint16_t> wire(in.size());
    std::vector<float> out(in.size());
    encode(type, in.data(), wire.data(), in.size());
    decode(type, wire.data(), out.data(), in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      const uint16_t expect = type == WireDType::BFloat16 ? to_bfloat16(in[i]) : to_float16(in[i]);
      CHECK(wire[i] == expect);
      CHECK(std::bit_cast<uint32_t>(out[i]) ==
            std::bit_cast<uint32_t>(type == WireDType::BFloat16 ? from_bfloat16(expect) : from_float16(expect)));
    }
  }
  CHECK(std::string(to_string(WireDType::BFloat16)) == "bf16");
}

TEST_CASE("C API: wire_dtype defaults to f32; a bad value and a 16-bit wire on CUDA are refused, naming them") {
  CHECK(psgd_config_default().wire_dtype == PSGD_WIRE_F32);
  psgd_comm* comm = test::c_comm_of_one();
  psgd_config config = psgd_config_default();
  psgd_reducer* reducer = nullptr;
  config.wire_dtype = 7;
  CHECK(psgd_reducer_create(comm, &config, &reducer) == PSGD_ERR_INVALID_ARGUMENT);
  CHECK(std::string(psgd_last_error()).find("config.wire_dtype = 7: expected f32 (0), bf16 (1) or fp16 (2)") !=
        std::string::npos);
  CHECK(reducer == nullptr);
  config.wire_dtype = PSGD_WIRE_BF16;
  config.device = 1;
  CHECK(psgd_reducer_create(comm, &config, &reducer) == PSGD_ERR_UNSUPPORTED);
  CHECK(std::string(psgd_last_error()).find("config.wire_dtype = bf16 with config.device = Cuda") != std::string::npos);
  config.device = 0;
  REQUIRE(psgd_reducer_create(comm, &config, &reducer) == PSGD_OK);
  psgd_reducer_destroy(reducer);
  psgd_comm_destroy(comm);
}
