// CPU implementation of gather_pages / scatter_pages: at::parallel_for over the
// (row, layer) pages of a batch, one memcpy each.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "staging_ops.h"

namespace hf3fsctl {
namespace {

template <typename index_t>
void copy_pages_cpu(uint8_t* cache, uint8_t* table, const index_t* ids, const PageGeometry& g,
                    bool to_table) {
  check_block_ids(ids, g.rows, g.num_blocks);
  // About 1 MiB of pages per task: large enough to amortise the task, small enough to share.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / g.page_size);
  at::parallel_for(0, g.rows * g.num_layers, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t row = p / g.num_layers;
      const int64_t layer = p % g.num_layers;
      uint8_t* cache_page = cache + g.offset + layer * g.layer_stride +
                            static_cast<int64_t>(ids[row]) * g.block_stride;
      uint8_t* table_page = table + row * g.row_stride + g.column + layer * g.page_size;
      if (to_table) {
        std::memcpy(table_page, cache_page, g.page_size);
      } else {
        std::memcpy(cache_page, table_page, g.page_size);
      }
    }
  });
}

void copy_pages(const at::Tensor& cache, const at::Tensor& table, const at::Tensor& block_ids,
                const PageGeometry& g, bool to_table) {
  TORCH_CHECK_VALUE(cache.is_cpu() && table.is_cpu() && block_ids.is_cpu(),
                    "the CPU op needs cache, staging table and block_ids on the CPU");
  if (g.rows == 0) {
    return;
  }
  const at::Tensor ids = block_ids.contiguous();
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "hf3fsctl_copy_pages_cpu", [&] {
    copy_pages_cpu<index_t>(static_cast<uint8_t*>(cache.data_ptr()),
                            static_cast<uint8_t*>(table.data_ptr()),
                            ids.data_ptr<index_t>(), g, to_table);
  });
}

void gather_pages_cpu(const at::Tensor& cache, at::Tensor& out, const at::Tensor& block_ids,
                      int64_t offset, int64_t layer_stride, int64_t block_stride,
                      int64_t num_layers, int64_t num_blocks, int64_t page_size,
                      int64_t out_column) {
  const PageGeometry g = check_pages(cache, out, block_ids, offset, layer_stride, block_stride,
                                     num_layers, num_blocks, page_size, out_column);
  copy_pages(cache, out, block_ids, g, /*to_table=*/true);
}

void scatter_pages_cpu(at::Tensor& cache, const at::Tensor& src, const at::Tensor& block_ids,
                       int64_t offset, int64_t layer_stride, int64_t block_stride,
                       int64_t num_layers, int64_t num_blocks, int64_t page_size,
                       int64_t src_column) {
  const PageGeometry g = check_pages(cache, src, block_ids, offset, layer_stride, block_stride,
                                     num_layers, num_blocks, page_size, src_column);
  copy_pages(cache, src, block_ids, g, /*to_table=*/false);
}

}  // namespace
}  // namespace hf3fsctl

TORCH_LIBRARY_IMPL(hf3fsctl, CPU, m) {
  m.impl("gather_pages", &hf3fsctl::gather_pages_cpu);
  m.impl("scatter_pages", &hf3fsctl::scatter_pages_cpu);
}
