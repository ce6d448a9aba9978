// The collective halves of the job checkpoint (Reducer::save_job / load_job,
// docs/engine.md): rank 0 alone touches the file, every rank learns the outcome,
// and a failure on any rank becomes the same error on every rank (never a rank
// left waiting in a collective its peer skipped). Worker thread: these issue
// collectives on the reducer's communicator, ordered after its reductions.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "powersgd/comm.hpp"

namespace powersgd::engine {

// Collective. Every rank passes the outcome of its local part (null: it
// succeeded). When any rank failed, every rank throws an error of the first
// failing rank's type (ErrorCode) whose message names `what`, that rank and its
// message; otherwise returns. One allgather of a fixed-size record per rank.
void agree_on_outcome(Communicator& comm, std::exception_ptr local, const std::string& what);

// Collective: the mean over the ranks of every bucket's error memory, in place
// (summed in double precision, so the mean does not depend on the order of the sum).
void average_error_memories(Communicator& comm, std::vector<CheckpointBucket>& buckets);

// Collective: rank 0 writes `encode()`'s bytes to `path` (write_checkpoint_file:
// durable when it returns), the other ranks write nothing; every rank returns
// once the file is durable, or throws rank 0's error.
void write_on_rank0(Communicator& comm, const std::string& path, const std::function<std::vector<char>()>& encode);

// Collective: rank 0 reads `path` and broadcasts its bytes, so the other ranks
// need no shared filesystem; rank 0's read error is thrown on every rank.
std::vector<char> read_on_rank0(Communicator& comm, const std::string& path);

}  // namespace powersgd::engine
