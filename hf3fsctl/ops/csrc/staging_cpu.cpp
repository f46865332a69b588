// CPU implementation of gather_pages / scatter_pages: at::parallel_for over the
// (row, layer) pages of a batch, one memcpy each.
#include <ATen/Parallel.h>

#include <cstring>

#include "staging_ops.h"

namespace hf3fsctl {
namespace {

void copy_pages_cpu(uint8_t* cache, uint8_t* table, const int64_t* ids, const PageGeometry& g,
                    bool to_table) {
  // About 1 MiB of pages per task: large enough to amortise the task, small enough to share.
  const int64_t grain = std::max<int64_t>(1, kCpuTaskBytes / g.page_size);
  at::parallel_for(0, g.rows * g.num_layers, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t row = p / g.num_layers;
      const int64_t layer = p % g.num_layers;
      uint8_t* cache_page =
          cache + g.offset + layer * g.layer_stride + ids[row] * g.block_stride;
      uint8_t* table_page = table + row * g.row_stride + g.column + layer * g.page_size;
      if (to_table) {
        std::memcpy(table_page, cache_page, g.page_size);
      } else {
        std::memcpy(cache_page, table_page, g.page_size);
      }
    }
  });
}

// The ids were range-checked by check_pages.
void copy_pages(const at::Tensor& cache, const at::Tensor& table, c10::IntArrayRef block_ids,
                const PageGeometry& g, bool to_table) {
  TORCH_CHECK_VALUE(cache.is_cpu() && table.is_cpu(),
                    "the CPU op needs the cache and the staging table on the CPU");
  if (g.rows == 0) {
    return;
  }
  copy_pages_cpu(static_cast<uint8_t*>(cache.data_ptr()), static_cast<uint8_t*>(table.data_ptr()),
                 block_ids.data(), g, to_table);
}

void gather_pages_cpu(const at::Tensor& cache, at::Tensor& out, c10::IntArrayRef block_ids,
                      c10::IntArrayRef geometry) {
  const PageGeometry g = check_pages(cache, out, block_ids, geometry);
  copy_pages(cache, out, block_ids, g, /*to_table=*/true);
}

void scatter_pages_cpu(at::Tensor& cache, const at::Tensor& src, c10::IntArrayRef block_ids,
                       c10::IntArrayRef geometry) {
  const PageGeometry g = check_pages(cache, src, block_ids, geometry);
  copy_pages(cache, src, block_ids, g, /*to_table=*/false);
}

}  // namespace
}  // namespace hf3fsctl

TORCH_LIBRARY_IMPL(hf3fsctl, CPU, m) {
  m.impl("gather_pages", &hf3fsctl::gather_pages_cpu);
  m.impl("scatter_pages", &hf3fsctl::scatter_pages_cpu);
}
