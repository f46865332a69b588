// The op schemas: one TORCH_LIBRARY for the namespace; implementations register per
// device in staging_cpu.cpp and staging_cuda.cu.
#include <torch/library.h>

TORCH_LIBRARY(hf3fsctl, m) {
  // Copies every (block, layer) page of block_ids from `cache` into row r of `out`.
  // `geometry` is the segment's [offset, layer_stride, block_stride, num_layers, num_blocks,
  // page_size, column]: block b of layer l is cache[offset + l*layer_stride +
  // b*block_stride, ... + page_size), and row r holds block_ids[r]'s pages layer after
  // layer from byte `column`. Ids and geometry are host int lists: no index tensor to
  // build per call, none to copy to the device, and two arguments to parse instead of
  // eight (an `int` argument costs about as much as an `int[]` at the dispatcher; see
  // docs/staging-ops.md). One copy-engine call or one kernel launch on CUDA.
  m.def("gather_pages(Tensor cache, Tensor(a!) out, int[] block_ids, int[] geometry) -> ()");
  // The inverse: writes nothing but the named blocks' pages of `cache`.
  m.def("scatter_pages(Tensor(a!) cache, Tensor src, int[] block_ids, int[] geometry) -> ()");
}
