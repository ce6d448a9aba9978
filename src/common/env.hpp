// The one registry of environment variables the library reads (docs/env.md is
// generated from the same table by `powersgd-run --print-env`). Reading a
// variable that is not registered here is an internal error, so the table stays
// complete.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace powersgd::env {

struct Variable {
  std::string_view name;
  std::string_view default_value;  // empty: no default
  std::string_view description;
};

// Every variable the library and its tools read, in documentation order.
std::span<const Variable> variables();

// The variable's value if set and non-empty. `name` must be registered.
std::optional<std::string> get(std::string_view name);

// The value, or the registered default.
std::string get_or_default(std::string_view name);

// Integer value within [min, max]; a malformed or out-of-range value throws
// InvalidArgumentError naming the variable, the value and the range.
int64_t get_int(std::string_view name, int64_t min, int64_t max);

// A switch: true for "1", false for "0" (the registered default where unset); any other value throws
// InvalidArgumentError naming the variable, the value and what each setting means ("expected 1 (`on`) or 0
// (`off`)").
bool get_switch(std::string_view name, std::string_view on, std::string_view off);

// The first of `names` that is set (for RANK / OMPI_COMM_WORLD_RANK / ... chains),
// with the name that supplied it.
struct Found {
  std::string name;
  std::string value;
};
std::optional<Found> first_of(std::initializer_list<std::string_view> names);

}  // namespace powersgd::env
