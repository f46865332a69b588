// The op schemas: one TORCH_LIBRARY for the namespace; implementations register per
// device in staging_cpu.cpp and staging_cuda.cu.
#include <torch/library.h>

TORCH_LIBRARY(hf3fsctl, m) {
  // Copies every (block, layer) page of block_ids from `cache` into row r of `out`
  // (layers in order from byte `out_column`). One launch on CUDA; ids on the cache's device.
  m.def(
      "gather_pages(Tensor cache, Tensor(a!) out, Tensor block_ids, int offset, "
      "int layer_stride, int block_stride, int num_layers, int num_blocks, int page_size, "
      "int out_column) -> ()");
  // The inverse: writes nothing but the named blocks' pages of `cache`.
  m.def(
      "scatter_pages(Tensor(a!) cache, Tensor src, Tensor block_ids, int offset, "
      "int layer_stride, int block_stride, int num_layers, int num_blocks, int page_size, "
      "int src_column) -> ()");
}
