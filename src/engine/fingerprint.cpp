#include "engine/fingerprint.hpp"

#include "engine/config_fields.hpp"

namespace powersgd::engine {

uint64_t config_fingerprint(const Config& config) {
  Fnv h;
  for_each_config_field(config, [&](const FieldSpec& spec, const auto& value) {
    if (spec.scope != FieldScope::PerRank && field_in_use(spec, config)) h.add(value);
  });
  return h.value();
}

uint64_t extend_layout_fingerprint(uint64_t previous, int index, std::span<const Shape> shapes) {
  Fnv h;
  h.add(previous);
  h.add(index);
  h.add(shapes.size());
  for (const auto& shape : shapes) {
    h.add(shape.size());
    for (int64_t d : shape) h.add(d);
  }
  return h.value();
}

uint64_t reducer_fingerprint(uint64_t layout, const Config& config) {
  Fnv both;
  both.add(layout);
  both.add(config_fingerprint(config));
  return both.value();
}

}  // namespace powersgd::engine
