// libFuzzer target: the store's frame codec (transport/store/protocol.hpp).
// The input is split into a program (which fields to read) and a frame stream.
// Frames are cut from the stream as the server cuts them (u32 length, bounded
// by kMaxFrameBytes), then read field by field with protocol::Reader. Checked:
// no read runs past the body (ASan), a string never exceeds its bound, and
// every value read re-encodes with protocol::Writer to exactly the bytes it was
// read from (the encoding is canonical), so decoder and encoder agree.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "store/protocol.hpp"

namespace {

namespace protocol = powersgd::transport::protocol;

// Aborts (a libFuzzer finding) with a reason.
void expect(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_store_frames: property violated: %s\n", what);
    std::abort();
  }
}

// The bytes a Writer produces for its fields, without the length and type prefix.
std::vector<char> fields_of(protocol::Writer& writer) {
  std::vector<char> frame = writer.finish();
  return {frame.begin() + 5, frame.end()};
}

void check_frame_body(FuzzedDataProvider& program, const char* body, size_t size) {
  protocol::Reader in(body, size);
  size_t consumed = 0;
  while (program.remaining_bytes() > 0) {
    protocol::Writer again(0);
    bool ok = false;
    switch (program.ConsumeIntegralInRange<int>(0, 4)) {
      case 0:
        if (auto v = in.u8()) again.u8(*v), ok = true;
        break;
      case 1:
        if (auto v = in.u32()) again.u32(*v), ok = true;
        break;
      case 2:
        if (auto v = in.u64()) again.u64(*v), ok = true;
        break;
      case 3:
        if (auto v = in.i64()) again.i64(*v), ok = true;
        break;
      case 4: {
        const size_t bound = program.ConsumeIntegralInRange<size_t>(0, powersgd::transport::kMaxKeyBytes);
        if (auto v = in.str(bound)) {
          expect(v->size() <= bound, "a string longer than its bound was accepted");
          again.str(*v);
          ok = true;
        }
        break;
      }
    }
    if (!ok) return;  // a failed read leaves the frame malformed: the server stops there
    std::vector<char> encoded = fields_of(again);
    expect(consumed + encoded.size() <= size, "a read went past the frame body");
    expect(std::memcmp(encoded.data(), body + consumed, encoded.size()) == 0,
           "a value read does not re-encode to the bytes it came from");
    consumed += encoded.size();
    expect(in.done() == (consumed == size), "done() disagrees with the bytes consumed");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider split(data, size);
  // The first byte says how much of the input is the read program.
  const size_t program_size = split.ConsumeIntegralInRange<size_t>(0, 64);
  std::vector<uint8_t> program_bytes = split.ConsumeBytes<uint8_t>(program_size);
  std::vector<uint8_t> stream = split.ConsumeRemainingBytes<uint8_t>();
  FuzzedDataProvider program(program_bytes.data(), program_bytes.size());

  size_t at = 0;
  bool authenticated = false;
  while (stream.size() - at >= 4) {
    const uint32_t length = protocol::decode_u32(stream.data() + at);
    const size_t limit = authenticated ? protocol::kMaxFrameBytes : protocol::kMaxHelloBytes;
    if (length == 0 || length > limit || length > stream.size() - at - 4) break;  // the server closes here
    const char* frame = reinterpret_cast<const char*>(stream.data() + at + 4);
    const auto type = static_cast<uint8_t>(frame[0]);
    // Writer's length field is what decode_u32 reads back.
    protocol::Writer header(type);
    std::vector<char> empty = header.finish();
    expect(protocol::decode_u32(reinterpret_cast<const unsigned char*>(empty.data())) == 1,
           "Writer's length field does not decode to the body size");
    check_frame_body(program, frame + 1, length - 1);
    authenticated = authenticated || type == static_cast<uint8_t>(protocol::Request::Hello);
    at += 4 + length;
  }
  return 0;
}
