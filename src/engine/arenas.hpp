// Where the engine's floats live: each bucket's device buffers, the arenas the
// collectives reduce (all buckets' ranges side by side, so reduce_all sends one
// collective per arena), and their host staging when the backend's memory is
// not host-accessible. Laid out once, at the first reduce (or load).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "compute/backend.hpp"
#include "engine/plan.hpp"

namespace powersgd::engine {

// One bucket: its plan, its device buffers and its slice of every arena.
struct BucketState {
  BucketPlan plan;
  std::vector<Shape> shapes;
  // Work buffer (layout in plan.hpp) plus one float: the finite flag of plain steps.
  compute::DeviceBuffer in;
  // Negated error-feedback memory, in the work buffer's layout (error = in - out;
  // keeping out - in lets one gemm produce it and one subtract consume it).
  compute::DeviceBuffer nerr;
  // Whole bucket only: the side x side output, and the plain step's buffer.
  compute::DeviceBuffer tmp;
  // In the first-collective arena: the packed uncompressed tensors, the finite
  // flag, then P (packed_numel + 1 + p_numel floats from unc_offset).
  int64_t unc_offset = 0, p_work_offset = 0;
  int64_t p_offset = 0, q_offset = 0;  // in the P state arena; in the Q arenas
  bool q_initialized = false;
  uint64_t draws = 0;
  std::vector<float> host_plain;  // staging of plain steps when the backend is not host-accessible
  double last_m2 = std::nan(""), last_e2 = std::nan("");
  int current_rank = 1;  // Stats::current_rank

  // The buffer a plain (uncompressed) step reduces: numel floats and the flag.
  float* plain_buffer() const { return plan.whole ? tmp.data() : in.data(); }
};

// A range of an arena: device pointer, and where it is staged on the host (the
// same pointer when the backend is host-accessible).
struct Segment {
  float* dev;
  float* host;
  size_t count;
};

struct Arenas {
  // Allocates every bucket's buffers and the arenas, and sets each bucket's offsets.
  void allocate(compute::Backend& backend, std::vector<std::unique_ptr<BucketState>>& buckets, bool error_feedback);

  Segment unc_segment(int64_t offset, int64_t count) { return segment(unc, unc_host, offset, count); }
  Segment q_segment(int64_t offset, int64_t count) { return segment(q_work, q_host, offset, count); }
  Segment plain_segment(BucketState& s) const;

  bool host_accessible = true;
  compute::DeviceBuffer unc;      // packed tensors, flags and P (this step's) of every bucket
  compute::DeviceBuffer q_work;   // this step's Q of every bucket
  compute::DeviceBuffer p_state;  // warm-start P and Q, kept between steps
  compute::DeviceBuffer q_state;
  std::vector<float> unc_host, q_host;

 private:
  Segment segment(compute::DeviceBuffer& arena, std::vector<float>& host, int64_t offset, int64_t count) const;
};

// This rank's error memory in the bucket's own element order (host). Worker thread.
std::vector<float> read_error(compute::Backend& backend, const BucketState& s);
void write_error(compute::Backend& backend, BucketState& s, const std::vector<float>& error);

}  // namespace powersgd::engine
