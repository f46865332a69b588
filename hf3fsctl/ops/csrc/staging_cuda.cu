// CUDA implementation of gather_pages / scatter_pages: ONE launch per call moves every
// (row, layer) page of the batch, one thread block per page, block ids read on the device.
// The staging table may be device memory or pinned host memory; pinned memory is accessed
// in place through its mapped device pointer (zero-copy over PCIe, no bounce buffer).
// Copies are 16 bytes wide when every address, stride and size allows, else 8/4/2/1.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "staging_ops.h"

namespace hf3fsctl {
namespace {

constexpr int kUnroll = 4;       // independent loads in flight per thread before the stores
constexpr int kMaxThreads = 256;

template <typename vec_t, typename index_t, bool kToTable>
__global__ void copy_pages_kernel(uint8_t* __restrict__ cache, uint8_t* __restrict__ table,
                                  const index_t* __restrict__ ids, PageGeometry g) {
  const int64_t page = blockIdx.x;
  const int64_t row = page / g.num_layers;
  const int64_t layer = page - row * g.num_layers;
  const int64_t block = static_cast<int64_t>(ids[row]);
  if (block < 0 || block >= g.num_blocks) {
    return;  // the Python caller checks ids; never touch memory outside the cache
  }
  uint8_t* cache_page = cache + g.offset + layer * g.layer_stride + block * g.block_stride;
  uint8_t* table_page = table + row * g.row_stride + g.column + layer * g.page_size;
  const vec_t* __restrict__ src =
      reinterpret_cast<const vec_t*>(kToTable ? cache_page : table_page);
  vec_t* __restrict__ dst = reinterpret_cast<vec_t*>(kToTable ? table_page : cache_page);
  const int64_t n = g.page_size / static_cast<int64_t>(sizeof(vec_t));
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t base = threadIdx.x; base < n; base += step) {
    vec_t v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < n) dst[i] = v[u];
    }
  }
}

// The device address of the staging table: its own pointer on the GPU, the mapped
// pointer of pinned host memory; pageable host memory is a caller error.
uint8_t* table_device_pointer(const at::Tensor& table, const at::Device& device) {
  uint8_t* ptr = static_cast<uint8_t*>(table.data_ptr());
  if (table.is_cuda()) {
    TORCH_CHECK_VALUE(table.device() == device, message("staging table is on ", table.device(),
                                                        ", the cache on ", device));
    return ptr;
  }
  TORCH_CHECK_VALUE(table.is_cpu(), "staging table must be a CUDA or pinned CPU tensor");
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls are not blamed
  }
  TORCH_CHECK_VALUE(err == cudaSuccess && attr.type == cudaMemoryTypeHost &&
                        attr.devicePointer != nullptr,
                    "host staging table must be pinned (page-locked) memory");
  return static_cast<uint8_t*>(attr.devicePointer);
}

int vector_width(uint64_t bits) {
  for (int width : {16, 8, 4, 2}) {
    if (bits % width == 0) return width;
  }
  return 1;
}

template <typename vec_t, typename index_t, bool kToTable>
void launch(uint8_t* cache, uint8_t* table, const index_t* ids, const PageGeometry& g) {
  const int64_t vecs = g.page_size / static_cast<int64_t>(sizeof(vec_t));
  const int64_t wanted = (vecs + kUnroll - 1) / kUnroll;
  const int threads =
      static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (wanted + 31) / 32 * 32)));
  const int64_t pages = g.rows * g.num_layers;
  TORCH_CHECK_VALUE(pages <= std::numeric_limits<int32_t>::max(), "too many pages in one batch");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  copy_pages_kernel<vec_t, index_t, kToTable>
      <<<static_cast<unsigned int>(pages), threads, 0, stream>>>(cache, table, ids, g);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kToTable>
void copy_pages(const at::Tensor& cache, const at::Tensor& table, const at::Tensor& block_ids,
                const PageGeometry& g) {
  TORCH_CHECK_VALUE(cache.is_cuda(), "the CUDA op needs the cache on a CUDA device");
  TORCH_CHECK_VALUE(block_ids.device() == cache.device(),
                    message("block_ids are on ", block_ids.device(), ", the cache on ",
                            cache.device()));
  if (g.rows == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(cache.device());
  uint8_t* cache_ptr = static_cast<uint8_t*>(cache.data_ptr());
  uint8_t* table_ptr = table_device_pointer(table, cache.device());
  const at::Tensor ids = block_ids.contiguous();
  const uint64_t bits = reinterpret_cast<uint64_t>(cache_ptr) | reinterpret_cast<uint64_t>(table_ptr) |
                        g.offset | g.layer_stride | g.block_stride | g.page_size | g.column |
                        g.row_stride;
  const int width = vector_width(bits);
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "hf3fsctl_copy_pages_cuda", [&] {
    const index_t* id_ptr = ids.data_ptr<index_t>();
    switch (width) {
      case 16: launch<uint4, index_t, kToTable>(cache_ptr, table_ptr, id_ptr, g); break;
      case 8: launch<uint2, index_t, kToTable>(cache_ptr, table_ptr, id_ptr, g); break;
      case 4: launch<uint32_t, index_t, kToTable>(cache_ptr, table_ptr, id_ptr, g); break;
      case 2: launch<uint16_t, index_t, kToTable>(cache_ptr, table_ptr, id_ptr, g); break;
      default: launch<uint8_t, index_t, kToTable>(cache_ptr, table_ptr, id_ptr, g); break;
    }
  });
}

void gather_pages_cuda(const at::Tensor& cache, at::Tensor& out, const at::Tensor& block_ids,
                       int64_t offset, int64_t layer_stride, int64_t block_stride,
                       int64_t num_layers, int64_t num_blocks, int64_t page_size,
                       int64_t out_column) {
  const PageGeometry g = check_pages(cache, out, block_ids, offset, layer_stride, block_stride,
                                     num_layers, num_blocks, page_size, out_column);
  copy_pages<true>(cache, out, block_ids, g);
}

void scatter_pages_cuda(at::Tensor& cache, const at::Tensor& src, const at::Tensor& block_ids,
                        int64_t offset, int64_t layer_stride, int64_t block_stride,
                        int64_t num_layers, int64_t num_blocks, int64_t page_size,
                        int64_t src_column) {
  const PageGeometry g = check_pages(cache, src, block_ids, offset, layer_stride, block_stride,
                                     num_layers, num_blocks, page_size, src_column);
  copy_pages<false>(cache, src, block_ids, g);
}

}  // namespace
}  // namespace hf3fsctl

TORCH_LIBRARY_IMPL(hf3fsctl, CUDA, m) {
  m.impl("gather_pages", &hf3fsctl::gather_pages_cuda);
  m.impl("scatter_pages", &hf3fsctl::scatter_pages_cuda);
}
