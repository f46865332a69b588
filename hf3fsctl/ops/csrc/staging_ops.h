// Shared declarations of the hf3fsctl staging ops: page geometry and the caller checks
// every implementation (CPU, CUDA) runs before it moves a byte.
//
// A KV cache segment is a 1-D uint8 tensor in which block b of layer l is the byte range
// [offset + l*layer_stride + b*block_stride, ... + page_size). The staging side is a 2-D
// uint8 "table" [n, row_bytes] (stride(1) == 1) whose row r holds block_ids[r]'s pages,
// layer after layer, starting at byte `column`.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

namespace hf3fsctl {

// Error messages are assembled here without iostreams and handed to TORCH_CHECK as ONE
// std::string (c10::str passes a single string through untouched). On the device image
// (g++ 13.3, -std=c++20, torch 2.11) c10::str's ostream formatting of an integer inside
// this library crashed the process instead of raising (see NOTES.md).
inline void append_part(std::string& out, const char* part) { out += part; }
inline void append_part(std::string& out, const std::string& part) { out += part; }
inline void append_part(std::string& out, int64_t part) { out += std::to_string(part); }
inline void append_part(std::string& out, int32_t part) { out += std::to_string(part); }
inline void append_part(std::string& out, c10::ScalarType part) { out += c10::toString(part); }
inline void append_part(std::string& out, const c10::Device& part) { out += part.str(); }

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  (append_part(out, parts), ...);
  return out;
}

struct PageGeometry {
  int64_t offset;
  int64_t layer_stride;
  int64_t block_stride;
  int64_t num_layers;
  int64_t num_blocks;
  int64_t page_size;
  int64_t column;     // first byte of this segment's pages in a table row
  int64_t rows;       // pages to move per layer (block_ids.numel())
  int64_t row_stride; // bytes between table rows
};

// Layers back to back inside a block are one contiguous page (block-outermost layouts):
// one range per block instead of num_layers small ones. The CUDA op and the 1-block path
// (one_block.cpp) both move pages in this merged form.
inline PageGeometry merge_contiguous_layers(PageGeometry g) {
  if (g.num_layers > 1 && g.layer_stride == g.page_size) {
    g.page_size *= g.num_layers;
    g.num_layers = 1;
    g.layer_stride = 0;
  }
  return g;
}

// One segment registered for the 1-block path (one_block.cpp): a handle stands for it, so a
// 1-block call passes no geometry and runs no check but the block id's range.
struct OneBlockSegment {
  uint8_t* cache;    // the cache's first byte (the segment's buffer, offset not applied)
  int device_index;  // the CUDA device; -1 for a CPU cache
  PageGeometry g;    // merged (merge_contiguous_layers); one row
};

// What the 1-block C entry points return. Anything but kOneBlockDone moved nothing, and
// tells the caller to take the op path instead, which then raises the op's own exception
// (or, for a pitch the copy engine refuses, launches the kernel).
enum OneBlockStatus : int {
  kOneBlockDone = 0,
  kOneBlockRefused = 1,  // unknown handle, block id out of range, the runtime refused the copy
  kOneBlockFailed = 2,   // a C++ exception (none may cross the C boundary)
};

// The CUDA half of the 1-block path, installed by staging_cuda.cu when it is loaded (a
// CPU-only build has none, and registers CPU segments only). Neither function throws.
struct OneBlockCuda {
  bool (*accepts)(const OneBlockSegment& segment) noexcept;  // e.g. the 2-D copy's pitch limit
  int (*copy)(const OneBlockSegment& segment, int64_t block, uint8_t* table,
              bool to_table) noexcept;
};
void install_one_block_cuda(OneBlockCuda cuda) noexcept;

// Bytes of pages per task of the CPU op's parallel loop: a call of fewer runs serially in the
// calling thread (staging_cpu.cpp), as the 1-block path's CPU copy always does.
constexpr int64_t kCpuTaskBytes = int64_t{1} << 20;

// Raises IndexError unless every one of the block ids is in [0, num_blocks).
inline void check_block_ids(c10::IntArrayRef ids, int64_t num_blocks) {
  for (const int64_t id : ids) {
    TORCH_CHECK_INDEX(id >= 0 && id < num_blocks, message("block id ", id, " out of range for ",
                                                          num_blocks, " blocks"));
  }
}

// Validates the arguments of gather_pages/scatter_pages, block ids included; raises
// c10::Error (ValueError / IndexError in Python) on any caller mistake.
// `geometry` is [offset, layer_stride, block_stride, num_layers, num_blocks, page_size,
// column] (the ops' schema, registration.cpp).
inline PageGeometry check_pages(const at::Tensor& cache, const at::Tensor& table,
                                c10::IntArrayRef block_ids, c10::IntArrayRef geometry) {
  TORCH_CHECK_VALUE(geometry.size() == 7,
                    message("geometry must be [offset, layer_stride, block_stride, num_layers, "
                            "num_blocks, page_size, column], got ",
                            static_cast<int64_t>(geometry.size()), " values"));
  const int64_t offset = geometry[0], layer_stride = geometry[1], block_stride = geometry[2];
  const int64_t num_layers = geometry[3], num_blocks = geometry[4], page_size = geometry[5];
  const int64_t column = geometry[6];
  TORCH_CHECK_VALUE(cache.scalar_type() == at::kByte && cache.dim() == 1,
                    message("cache must be a 1-D uint8 tensor, got ", cache.scalar_type(),
                            " with ", cache.dim(), " dims"));
  TORCH_CHECK_VALUE(cache.numel() == 0 || cache.stride(0) == 1, "cache must be contiguous");
  TORCH_CHECK_VALUE(table.scalar_type() == at::kByte && table.dim() == 2,
                    message("staging table must be a 2-D uint8 tensor, got ",
                            table.scalar_type(), " with ", table.dim(), " dims"));
  TORCH_CHECK_VALUE(table.size(0) <= 1 || table.stride(1) == 1,
                    "staging table rows must be contiguous");
  TORCH_CHECK_VALUE(table.size(0) <= 1 || table.stride(0) >= table.size(1),
                    "staging table rows overlap");
  const int64_t rows = static_cast<int64_t>(block_ids.size());
  TORCH_CHECK_VALUE(rows == table.size(0), message("block_ids has ", rows, " entries for ",
                                                   table.size(0), " staging rows"));
  TORCH_CHECK_VALUE(num_layers > 0 && num_blocks > 0 && page_size > 0,
                    "num_layers, num_blocks and page_size must be positive");
  TORCH_CHECK_VALUE(offset >= 0 && layer_stride >= 0 && block_stride >= 0 && column >= 0,
                    "offset, strides and column must not be negative");
  TORCH_CHECK_VALUE(column + num_layers * page_size <= table.size(1),
                    message("pages of ", num_layers, " layers x ", page_size,
                            " B from column ", column, " overrun a ", table.size(1),
                            "-byte staging row"));
  const int64_t last = offset + (num_layers - 1) * layer_stride +
                       (num_blocks - 1) * block_stride + page_size;
  TORCH_CHECK_VALUE(last <= cache.numel(), message("segment reaches byte ", last, " of a ",
                                                   cache.numel(), "-byte cache"));
  check_block_ids(block_ids, num_blocks);
  const int64_t row_stride = table.size(0) <= 1 ? table.size(1) : table.stride(0);
  return PageGeometry{offset,    layer_stride, block_stride, num_layers, num_blocks,
                      page_size, column,       rows,         row_stride};
}

}  // namespace hf3fsctl
