// CUDA implementation of gather_pages / scatter_pages.
//
// * One block (one row of the staging table): one cudaMemcpy2DAsync per call — the copy
//   engine moves the block's per-layer pages (equal size, `layer_stride` apart) with no
//   kernel launch and no SM time, as fast as a pinned copy of the same bytes; a block
//   whose layers are one range is one cudaMemcpyAsync.
// * Several rows: ONE kernel launch per call. The work is cut into chunks of at most
//   kChunkBytes of one (row, layer) page, one thread block per chunk, so small per-layer
//   pages and whole-block pages alike keep the copy units busy.
// * Layers stored back to back inside a block (block-outermost layouts) are merged into
//   one page first: one contiguous range per block instead of num_layers small ones.
// * Block ids are a host list (`int[]`), range-checked by check_pages and, up to kInlineIds
//   of them, passed to the kernel by value in its parameters: no H2D copy, no allocation,
//   no synchronisation. More ids are copied to the device once and read from there.
// The staging table may be device memory or pinned host memory; the kernel accesses pinned
// memory in place through its mapped device pointer (zero-copy over PCIe, no bounce). The
// one-block copy also takes pageable memory (synchronously); the kernel path raises
// NotImplementedError for it, and hf3fsctl.staging takes the torch path instead.
// Copies are 16 bytes wide when every address, stride and size allows, else 8/4/2/1.
// The 1-block path past the dispatcher (one_block.cpp) issues the same one-row copy
// (issue_one_row) through the CUDA half installed at the end of this file.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <limits>

#include "staging_ops.h"

namespace hf3fsctl {
namespace {

constexpr int kUnroll = 4;  // independent loads in flight per thread before the stores
constexpr int kMaxThreads = 256;
constexpr int64_t kDefaultChunkBytes = 32 * 1024;
constexpr int kInlineIds = 512;  // 2 KiB of the 4 KiB kernel-parameter space

// Block ids passed by value (kernel parameter space; no device allocation).
struct InlineIds {
  int32_t id[kInlineIds];
  __device__ int64_t operator[](int64_t row) const { return id[row]; }
};

// Block ids in device memory (batches of more than kInlineIds blocks).
struct DeviceIds {
  const int64_t* ptr;
  __device__ int64_t operator[](int64_t row) const { return ptr[row]; }
};

template <typename vec_t, typename Ids, bool kToTable>
__global__ void __launch_bounds__(kMaxThreads)
    copy_pages_kernel(uint8_t* __restrict__ cache, uint8_t* __restrict__ table,
                      const __grid_constant__ Ids ids, const PageGeometry g, int64_t chunks,
                      int64_t chunk_vecs) {
  const int64_t unit = blockIdx.x;
  const int64_t page = unit / chunks;
  const int64_t chunk = unit - page * chunks;
  const int64_t row = page / g.num_layers;
  const int64_t layer = page - row * g.num_layers;
  const int64_t block = ids[row];
  if (block < 0 || block >= g.num_blocks) {
    return;  // host ids are checked before the launch; never touch memory outside the cache
  }
  uint8_t* cache_page = cache + g.offset + layer * g.layer_stride + block * g.block_stride;
  uint8_t* table_page = table + row * g.row_stride + g.column + layer * g.page_size;
  const vec_t* __restrict__ src =
      reinterpret_cast<const vec_t*>(kToTable ? cache_page : table_page);
  vec_t* __restrict__ dst = reinterpret_cast<vec_t*>(kToTable ? table_page : cache_page);
  const int64_t begin = chunk * chunk_vecs;
  const int64_t vecs = g.page_size / static_cast<int64_t>(sizeof(vec_t));
  const int64_t end = begin + chunk_vecs < vecs ? begin + chunk_vecs : vecs;
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t base = begin + threadIdx.x; base < end; base += step) {
    vec_t v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < end) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < end) dst[i] = v[u];
    }
  }
}

// The staging table's address for the copy engine: its own pointer, pinned or pageable
// host memory alike (unified addressing; a copy from or to pageable memory is synchronous).
// No pointer query: the one-block path costs no more host time than a plain copy.
uint8_t* table_copy_pointer(const at::Tensor& table, const at::Device& device) {
  if (table.is_cuda()) {
    TORCH_CHECK_VALUE(table.device() == device, message("staging table is on ", table.device(),
                                                        ", the cache on ", device));
  } else {
    TORCH_CHECK_VALUE(table.is_cpu(), "staging table must be a CUDA or CPU tensor");
  }
  return static_cast<uint8_t*>(table.data_ptr());
}

// The staging table's address for the kernel: its own pointer on the GPU, the mapped
// pointer of pinned host memory. Pageable host memory raises NotImplementedError (the
// caller's cue to take another path; nothing has been copied yet).
//
// cudaPointerGetAttributes needs a CUDA context current on the calling thread, and it
// does not make one: on a thread that has made no other CUDA call yet (the connector's
// load threads) it fails, and pinned memory looked pageable. So the device's primary
// context is made current first (cudaSetDevice initialises it on CUDA 12+; a no-op when
// it already is). Found by tests/gpu/test_worker_cuda.py: every asynchronous load failed.
uint8_t* table_device_pointer(const at::Tensor& table, const at::Device& device) {
  uint8_t* ptr = table_copy_pointer(table, device);
  if (table.is_cuda()) {
    return ptr;
  }
  C10_CUDA_CHECK(cudaSetDevice(device.index()));
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls are not blamed
  }
  TORCH_CHECK_NOT_IMPLEMENTED(
      err == cudaSuccess && attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr,
      message("the kernel needs pinned (page-locked) host staging (",
              err == cudaSuccess ? "memory type " + std::to_string(attr.type)
                                 : std::string(cudaGetErrorName(err)),
              ")"));
  return static_cast<uint8_t*>(attr.devicePointer);
}

int vector_width(uint64_t bits) {
  for (int width : {16, 8, 4, 2}) {
    if (bits % width == 0) return width;
  }
  return 1;
}

// Bytes one thread block moves. HF3FSCTL_STAGING_CHUNK_BYTES overrides the default: a
// tuning knob for benchmarks/bench_staging.py, not a setting (read per call: a getenv).
int64_t chunk_bytes() {
  const char* value = std::getenv("HF3FSCTL_STAGING_CHUNK_BYTES");
  if (value == nullptr || *value == '\0') return kDefaultChunkBytes;
  const long long parsed = std::atoll(value);
  return parsed >= 256 ? static_cast<int64_t>(parsed) / 256 * 256 : kDefaultChunkBytes;
}

template <typename vec_t, typename Ids, bool kToTable>
void launch(uint8_t* cache, uint8_t* table, const Ids& ids, const PageGeometry& g) {
  const int64_t vecs = g.page_size / static_cast<int64_t>(sizeof(vec_t));
  const int64_t chunk_vecs =
      std::max<int64_t>(1, std::min<int64_t>(vecs, chunk_bytes() / static_cast<int64_t>(sizeof(vec_t))));
  const int64_t chunks = (vecs + chunk_vecs - 1) / chunk_vecs;
  const int64_t wanted = (chunk_vecs + kUnroll - 1) / kUnroll;
  const int threads = static_cast<int>(
      std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (wanted + 31) / 32 * 32)));
  const int64_t units = g.rows * g.num_layers * chunks;
  TORCH_CHECK_VALUE(units <= std::numeric_limits<int32_t>::max(), "too many pages in one batch");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  copy_pages_kernel<vec_t, Ids, kToTable><<<static_cast<unsigned int>(units), threads, 0, stream>>>(
      cache, table, ids, g, chunks, chunk_vecs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Ids, bool kToTable>
void launch_widest(uint8_t* cache, uint8_t* table, const Ids& ids, const PageGeometry& g) {
  const uint64_t bits = reinterpret_cast<uint64_t>(cache) | reinterpret_cast<uint64_t>(table) |
                        g.offset | g.layer_stride | g.block_stride | g.page_size | g.column |
                        g.row_stride;
  switch (vector_width(bits)) {
    case 16: launch<uint4, Ids, kToTable>(cache, table, ids, g); break;
    case 8: launch<uint2, Ids, kToTable>(cache, table, ids, g); break;
    case 4: launch<uint32_t, Ids, kToTable>(cache, table, ids, g); break;
    case 2: launch<uint16_t, Ids, kToTable>(cache, table, ids, g); break;
    default: launch<uint8_t, Ids, kToTable>(cache, table, ids, g); break;
  }
}

// One row's copy on the copy engine, as the op and the 1-block path (one_block.cpp) both
// issue it: the block's pages as one 2-D copy (pitch: the layer stride), or one flat copy
// when its layers are one range (block-outermost, merged). `table` is the row's first byte.
template <bool kToTable>
cudaError_t issue_one_row(uint8_t* cache, uint8_t* table, int64_t block, const PageGeometry& g,
                          cudaStream_t stream) {
  uint8_t* cache_page = cache + g.offset + block * g.block_stride;
  uint8_t* table_page = table + g.column;
  const size_t width = static_cast<size_t>(g.page_size);
  if (g.num_layers == 1) {
    return kToTable ? cudaMemcpyAsync(table_page, cache_page, width, cudaMemcpyDefault, stream)
                    : cudaMemcpyAsync(cache_page, table_page, width, cudaMemcpyDefault, stream);
  }
  const size_t cache_pitch = static_cast<size_t>(g.layer_stride);
  const size_t rows = static_cast<size_t>(g.num_layers);
  return kToTable ? cudaMemcpy2DAsync(table_page, width, cache_page, cache_pitch, width, rows,
                                      cudaMemcpyDefault, stream)
                  : cudaMemcpy2DAsync(cache_page, cache_pitch, table_page, width, width, rows,
                                      cudaMemcpyDefault, stream);
}

// A pitch the runtime refuses (a layer stride past its limit): not an error of the copy.
bool refused_pitch(cudaError_t err) {
  return err == cudaErrorInvalidPitchValue || err == cudaErrorInvalidValue;
}

// One row: the copy engine. False when the runtime refuses the pitch: the caller launches
// the kernel.
template <bool kToTable>
bool copy_one_row(uint8_t* cache, uint8_t* table, int64_t block, const PageGeometry& g) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = issue_one_row<kToTable>(cache, table, block, g, stream);
  if (err != cudaSuccess && g.num_layers > 1 && refused_pitch(err)) {
    (void)cudaGetLastError();
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

template <bool kToTable>
void copy_pages(const at::Tensor& cache, const at::Tensor& table, c10::IntArrayRef block_ids,
                const PageGeometry& checked) {
  TORCH_CHECK_VALUE(cache.is_cuda(), "the CUDA op needs the cache on a CUDA device");
  if (checked.rows == 0) {
    return;
  }
  const PageGeometry g = merge_contiguous_layers(checked);
  const c10::cuda::CUDAGuard guard(cache.device());
  uint8_t* cache_ptr = static_cast<uint8_t*>(cache.data_ptr());
  // One block: the copy engine, not the kernel — for layer-outermost pages too, whose 2-D
  // copy costs ~2 us more than a flat one; the kernel was slower still (docs/staging-ops.md).
  if (g.rows == 1 &&
      copy_one_row<kToTable>(cache_ptr, table_copy_pointer(table, cache.device()), block_ids[0],
                             g)) {
    return;
  }
  uint8_t* table_ptr = table_device_pointer(table, cache.device());
  if (g.rows <= kInlineIds) {
    InlineIds inline_ids{};
    for (int64_t r = 0; r < g.rows; ++r) inline_ids.id[r] = static_cast<int32_t>(block_ids[r]);
    launch_widest<InlineIds, kToTable>(cache_ptr, table_ptr, inline_ids, g);
    return;
  }
  // From pageable memory: the copy has read `host` when it returns, so it may go at once.
  const at::Tensor host = at::tensor(block_ids, at::TensorOptions().dtype(at::kLong));
  const at::Tensor on_device = host.to(cache.device(), /*non_blocking=*/true);
  launch_widest<DeviceIds, kToTable>(cache_ptr, table_ptr,
                                     DeviceIds{on_device.data_ptr<int64_t>()}, g);
}

void gather_pages_cuda(const at::Tensor& cache, at::Tensor& out, c10::IntArrayRef block_ids,
                       c10::IntArrayRef geometry) {
  const PageGeometry g = check_pages(cache, out, block_ids, geometry);
  copy_pages<true>(cache, out, block_ids, g);
}

void scatter_pages_cuda(at::Tensor& cache, const at::Tensor& src, c10::IntArrayRef block_ids,
                        c10::IntArrayRef geometry) {
  const PageGeometry g = check_pages(cache, src, block_ids, geometry);
  copy_pages<false>(cache, src, block_ids, g);
}

// The 1-block path's CUDA half (one_block.cpp): a registered segment's layers must fit the
// 2-D copy's pitch limit (else the op's kernel serves it).
bool one_block_accepts(const OneBlockSegment& segment) noexcept {
  if (segment.g.num_layers == 1) return true;
  int max_pitch = 0;
  if (cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, segment.device_index) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return segment.g.layer_stride <= static_cast<int64_t>(max_pitch);
}

// The op's 1-block copy without the dispatcher: same device guard, same current stream,
// same copy calls (issue_one_row). A runtime error is cleared and reported as a refusal,
// so the caller's op call meets it afresh and raises as the op does.
int one_block_copy(const OneBlockSegment& segment, int64_t block, uint8_t* table,
                   bool to_table) noexcept {
  try {
    const auto device = static_cast<c10::DeviceIndex>(segment.device_index);
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
    const cudaError_t err =
        to_table ? issue_one_row<true>(segment.cache, table, block, segment.g, stream)
                 : issue_one_row<false>(segment.cache, table, block, segment.g, stream);
    if (err == cudaSuccess) return kOneBlockDone;
    (void)cudaGetLastError();
    return kOneBlockRefused;
  } catch (...) {
    return kOneBlockFailed;
  }
}

// Installs the CUDA half when the library is loaded (before any Python call can reach it).
struct InstallOneBlockCuda {
  InstallOneBlockCuda() { install_one_block_cuda(OneBlockCuda{&one_block_accepts, &one_block_copy}); }
};
const InstallOneBlockCuda install_at_load;

}  // namespace
}  // namespace hf3fsctl

TORCH_LIBRARY_IMPL(hf3fsctl, CUDA, m) {
  m.impl("gather_pages", &hf3fsctl::gather_pages_cuda);
  m.impl("scatter_pages", &hf3fsctl::scatter_pages_cuda);
}
