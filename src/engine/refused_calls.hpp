// Calls refused before they reach the Reducer whose Reducer call is collective
// (the C API's own checks: ndims out of range, a null path, a null handle
// pointer). The refusing rank still takes part in the call's collective
// refusal, so every rank fails at once, the others naming this rank and its
// reason (docs/errors.md, "Failed calls lose nothing"), instead of waiting out
// PSGD_TIMEOUT_MS while this rank's next collective pairs with their leftover one.
#pragma once

#include <exception>
#include <functional>

#include "powersgd/reducer.hpp"

namespace powersgd::detail {

struct RefusedCalls {
  // Each is collective as the Reducer call it names and throws `error` on this
  // rank; nothing is declared, reduced, saved or loaded on any rank.
  // add_bucket: the next bucket refused. reduce_async: the matching reduction
  // of `bucket` fails on every rank (it counts as reduced, as a null data does,
  // when the bucket is valid and not yet reduced in the step); returns once
  // its collectives are done, as every refused reduce does.
  [[noreturn]] static void add_bucket(Reducer& reducer, std::exception_ptr error);
  [[noreturn]] static void reduce_async(Reducer& reducer, int bucket, std::exception_ptr error);
  [[noreturn]] static void save_job(const Reducer& reducer, std::exception_ptr error);
  [[noreturn]] static void load_job(Reducer& reducer, std::exception_ptr error);
  // OuterOptimizer's construction and load (outer_optimizer.cpp), collective as they are on `comm`: every rank
  // fails, the others naming this rank and `error`; nothing set up or loaded on any rank.
  [[noreturn]] static void outer_create(Communicator& comm, std::exception_ptr error);
  [[noreturn]] static void outer_load(Communicator& comm, std::exception_ptr error);
};

// The exception fn throws, or null: a refusal to pass on.
inline std::exception_ptr exception_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

}  // namespace powersgd::detail
