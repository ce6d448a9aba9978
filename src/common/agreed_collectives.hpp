// Collectives for callers that have agreed on every rank's sizes by other means: the engine, whose order guard
// compares each reduction's sizes before its data collectives, and whose other messages have fixed sizes or
// follow a broadcast of their size. A Communicator made by create() runs these without the exchange of sizes
// its public collectives make first where Gloo's own algorithms run (docs/transport.md, "Sizes agreed first");
// any other Communicator runs its own collectives. Defined by the transport layer.
#pragma once

#include <cstddef>

#include "powersgd/comm.hpp"

namespace powersgd::detail {

Work allreduce_agreed_async(Communicator& comm, void* data, size_t count, DataType type);
// Communicator::allreduce_in_rank_order_async's sums (UnsupportedError where it has none).
Work allreduce_in_rank_order_agreed_async(Communicator& comm, void* data, size_t count, DataType type);
Work broadcast_agreed_async(Communicator& comm, void* data, size_t bytes, int root);
Work allgather_agreed_async(Communicator& comm, const void* in, void* out, size_t bytes);

}  // namespace powersgd::detail
