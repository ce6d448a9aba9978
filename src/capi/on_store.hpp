// psgd_comm_init_on_store's communicator: the Gloo communicator on a store
// made of the caller's callbacks (psgd_store_callbacks, powersgd.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "powersgd/comm.hpp"
#include "powersgd/powersgd.h"

// What a get callback fills through psgd_store_value_set.
struct psgd_store_value {
  std::vector<char> bytes;
  bool set = false;
};

namespace powersgd::capi {

// Collective over `size` ranks: rendezvous through `callbacks` (its struct_size already read by the caller by
// the rule of powersgd.h; checked: every function present, else InvalidArgumentError) under the key prefix
// run_id; settings from the environment (transport::apply_env_settings), the TCP transport bound to `address`
// unless PSGD_IFACE or PSGD_ADDR is set. Blocking up to the timeout. A failed callback throws the Error of its status, naming the key.
std::unique_ptr<Communicator> create_on_callback_store(int rank, int size, const std::string& run_id,
                                                       const psgd_store_callbacks& callbacks, const char* address);

}  // namespace powersgd::capi
