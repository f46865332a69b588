// The 1-block path past the dispatcher: plain C entry points that hf3fsctl.staging calls
// through ctypes for a call of one block (issue 23, docs/staging-ops.md).
//
// A 1-block gather/scatter through the op costs ~3 us of host time more than a pinned
// copy_ of the same bytes on an H200 host (the dispatcher parses two int[] arguments, the
// op re-checks geometry that never changes); for a 0.5 MiB page that is what keeps the call
// over 1.25x the copy. Here a segment's geometry is checked once, at registration, and a
// handle stands for it; a copy takes (handle, block, table pointer, direction), checks
// only the block id's range, and issues the copy the op would (the CUDA half:
// staging_cuda.cu; CPU caches: one memcpy per layer, like the CPU op).
//
// Nothing here throws: every entry point returns a status, and on any refusal the caller
// runs the op instead, which raises the op's own exception. Handles live in a fixed table
// (no reallocation under a concurrent copy); a slot is filled under a lock and published
// by its `used` flag.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include "staging_ops.h"

namespace hf3fsctl {
namespace {

constexpr int kMaxSegments = 4096;  // plans of 64 segment lists, many segments each

struct Slot {
  std::atomic<bool> used{false};
  OneBlockSegment segment{};
};

Slot slots[kMaxSegments];
std::mutex slots_lock;       // registration and release only; a copy takes no lock
OneBlockCuda cuda_half{};    // zero (no CUDA half) until staging_cuda.cu installs it

// Handles returned for refusals (all negative).
constexpr int kBadGeometry = -1;  // the op would raise for this geometry: leave it to the op
constexpr int kNoCudaHalf = -2;   // a CUDA cache, but this library has no CUDA code
constexpr int kRefusedCopy = -3;  // one copy cannot move it as well (CUDA: pitch limit; CPU:
                                  // more than one task of the CPU op's parallel loop)
constexpr int kTableFull = -4;

// check_pages' geometry checks, without a table (its row width is `row_bytes`) and
// without throwing; false where the op would raise.
bool geometry_fits(int64_t cache_bytes, const PageGeometry& g) {
  if (g.num_layers <= 0 || g.num_blocks <= 0 || g.page_size <= 0) return false;
  if (g.offset < 0 || g.layer_stride < 0 || g.block_stride < 0 || g.column < 0) return false;
  int64_t layers_bytes = 0, row_end = 0, layer_span = 0, block_span = 0, last = 0;
  if (__builtin_mul_overflow(g.num_layers, g.page_size, &layers_bytes) ||
      __builtin_add_overflow(g.column, layers_bytes, &row_end) || row_end > g.row_stride) {
    return false;
  }
  if (__builtin_mul_overflow(g.num_layers - 1, g.layer_stride, &layer_span) ||
      __builtin_mul_overflow(g.num_blocks - 1, g.block_stride, &block_span) ||
      __builtin_add_overflow(g.offset, layer_span, &last) ||
      __builtin_add_overflow(last, block_span, &last) ||
      __builtin_add_overflow(last, g.page_size, &last)) {
    return false;
  }
  return last <= cache_bytes;
}

void copy_cpu(const OneBlockSegment& s, int64_t block, uint8_t* table, bool to_table) {
  const PageGeometry& g = s.g;
  uint8_t* cache_page = s.cache + g.offset + block * g.block_stride;
  uint8_t* table_page = table + g.column;
  for (int64_t layer = 0; layer < g.num_layers; ++layer) {
    if (to_table) {
      std::memcpy(table_page, cache_page, static_cast<size_t>(g.page_size));
    } else {
      std::memcpy(cache_page, table_page, static_cast<size_t>(g.page_size));
    }
    cache_page += g.layer_stride;
    table_page += g.page_size;
  }
}

}  // namespace

void install_one_block_cuda(OneBlockCuda cuda) noexcept { cuda_half = cuda; }

}  // namespace hf3fsctl

using hf3fsctl::kOneBlockDone;
using hf3fsctl::kOneBlockFailed;
using hf3fsctl::kOneBlockRefused;

// Registers one segment of a KV cache for 1-block calls and returns its handle (>= 0), or a
// negative code where the op must serve it: a geometry the op would refuse (-1), a CUDA
// cache without the CUDA half (-2), a layout one copy would move worse than the op (-3: the
// 2-D copy's pitch limit, or a CPU block large enough for the CPU op's threads), a full
// table (-4). `cache` is the segment buffer's first byte, `cache_bytes` its length;
// `device_index` is -1 for a CPU cache; `row_bytes` is a staging row's width (every layer of
// every segment); the rest is the ops' `geometry` argument. Contiguous layers are merged
// here, as the CUDA op merges them per call.
extern "C" int hf3fsctl_one_block_register(void* cache, int64_t cache_bytes, int device_index,
                                           int64_t offset, int64_t layer_stride,
                                           int64_t block_stride, int64_t num_layers,
                                           int64_t num_blocks, int64_t page_size,
                                           int64_t column, int64_t row_bytes) noexcept {
  using namespace hf3fsctl;
  const PageGeometry g{offset,    layer_stride, block_stride, num_layers, num_blocks,
                       page_size, column,       1,            row_bytes};
  if (cache == nullptr || !geometry_fits(cache_bytes, g)) return kBadGeometry;
  const OneBlockSegment segment{static_cast<uint8_t*>(cache), device_index,
                                merge_contiguous_layers(g)};
  if (device_index >= 0) {
    if (cuda_half.copy == nullptr || cuda_half.accepts == nullptr) return kNoCudaHalf;
    if (!cuda_half.accepts(segment)) return kRefusedCopy;
  } else if (num_layers > std::max<int64_t>(1, kCpuTaskBytes / page_size)) {
    return kRefusedCopy;  // the CPU op would share these pages out to threads: let it
  }
  const std::lock_guard<std::mutex> lock(slots_lock);
  for (int handle = 0; handle < kMaxSegments; ++handle) {
    Slot& slot = slots[handle];
    if (!slot.used.load(std::memory_order_relaxed)) {
      slot.segment = segment;
      slot.used.store(true, std::memory_order_release);
      return handle;
    }
  }
  return kTableFull;
}

// Copies block `block`'s pages of the handle's segment to (to_table != 0) or from one
// staging row at `table` (its first byte; the segment's pages start at its column), on the
// current CUDA stream of the cache's device for a CUDA cache. Returns kOneBlockDone, or
// non-zero having moved nothing: the caller then runs the op, which raises (an id out of
// range: IndexError) or takes another way (the kernel). The table must be host memory (the
// caller checks; pinned or pageable, as for the op's 1-block copy) at least a row wide.
extern "C" int hf3fsctl_one_block_copy(int handle, int64_t block, void* table,
                                       int to_table) noexcept {
  using namespace hf3fsctl;
  if (handle < 0 || handle >= kMaxSegments || table == nullptr) return kOneBlockRefused;
  const Slot& slot = slots[handle];
  if (!slot.used.load(std::memory_order_acquire)) return kOneBlockRefused;
  const OneBlockSegment& segment = slot.segment;
  if (block < 0 || block >= segment.g.num_blocks) return kOneBlockRefused;
  uint8_t* row = static_cast<uint8_t*>(table);
  if (segment.device_index < 0) {
    copy_cpu(segment, block, row, to_table != 0);
    return kOneBlockDone;
  }
  const auto copy = cuda_half.copy;
  if (copy == nullptr) return kOneBlockRefused;
  const int status = copy(segment, block, row, to_table != 0);
  return status == kOneBlockDone || status == kOneBlockRefused ? status : kOneBlockFailed;
}

// Frees a handle (its plan is gone); unknown handles are ignored.
extern "C" void hf3fsctl_one_block_release(int handle) noexcept {
  using namespace hf3fsctl;
  if (handle < 0 || handle >= kMaxSegments) return;
  const std::lock_guard<std::mutex> lock(slots_lock);
  slots[handle].used.store(false, std::memory_order_release);
}

// Handles in use (for tests: plans release theirs when they go).
extern "C" int hf3fsctl_one_block_handles() noexcept {
  using namespace hf3fsctl;
  const std::lock_guard<std::mutex> lock(slots_lock);
  int used = 0;
  for (const Slot& slot : slots) used += slot.used.load(std::memory_order_relaxed) ? 1 : 0;
  return used;
}
