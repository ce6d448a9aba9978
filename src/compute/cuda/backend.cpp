// CUDA backend: cuBLAS for GEMM, cuSOLVER (geqrf + orgqr) for QR, and the
// kernels of kernels.cu for the rest. All work is enqueued on the backend's own
// stream; host-returning calls synchronize that stream only.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "common/check.hpp"
#include "common/log.hpp"
#include "compute/arguments.hpp"
#include "compute/backend.hpp"
#include "compute/cuda/backend.hpp"
#include "compute/cuda/check.hpp"
#include "compute/cuda/kernels.hpp"

namespace powersgd::compute {

namespace {

cublasOperation_t to_cublas(Transpose t) { return t == Transpose::No ? CUBLAS_OP_N : CUBLAS_OP_T; }

// Row stride of a contiguous matrix with `cols` columns, as gemm accepts it (>= 1).
int64_t ld(int64_t cols) { return std::max<int64_t>(1, cols); }

// Puts the calling thread's current device back when it goes (teardown runs on the caller's thread, e.g. a
// framework's, whose current device is its own). Never throws.
class DeviceRestorer {
 public:
  DeviceRestorer() noexcept { valid_ = cudaGetDevice(&device_) == cudaSuccess; }
  ~DeviceRestorer() {
    if (valid_) cudaSetDevice(device_);
  }
  DeviceRestorer(const DeviceRestorer&) = delete;
  DeviceRestorer& operator=(const DeviceRestorer&) = delete;

 private:
  int device_ = 0;
  bool valid_ = false;
};

// Scratch device memory that only grows; freed with the backend.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (ptr_ != nullptr) cudaFree(ptr_);  // teardown: nothing useful to do with a failure here
  }
  void* get(size_t bytes) {
    if (bytes > bytes_) {
      if (ptr_ != nullptr) PSGD_CUDA_CHECK(cudaFree(ptr_));
      ptr_ = nullptr;
      bytes_ = 0;
      PSGD_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
      bytes_ = bytes;
    }
    return ptr_;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    try {
      PSGD_CUDA_CHECK(cudaSetDevice(device_));
      cudaDeviceProp prop{};
      PSGD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
      int cublas_version = 0;
      // A blocking stream: its work waits for the work queued before it on the legacy default stream, where a
      // caller's kernels that write the gradient usually run (a non-blocking stream read the buffer before
      // they had written it). Work on other streams must be synchronized by the caller (reducer.hpp).
      PSGD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamDefault));
      PSGD_CUDA_CHECK(cublasCreate(&cublas_));
      PSGD_CUDA_CHECK(cublasSetStream(cublas_, stream_));
      PSGD_CUDA_CHECK(cublasGetVersion(cublas_, &cublas_version));
      PSGD_CUDA_CHECK(cusolverDnCreate(&cusolver_));
      PSGD_CUDA_CHECK(cusolverDnSetStream(cusolver_, stream_));
      name_ = powersgd::detail::concat("cuda (", prop.name, ", sm_", prop.major, prop.minor, ", device ", device_,
                                       ", cuBLAS ", cublas_version, ")");
      // Results of squared_norm / all_finite land here, then go to the host.
      PSGD_CUDA_CHECK(cudaMalloc(&result_, kResultBytes));
    } catch (...) {
      release();  // what was created before the failure (no destructor runs for a constructor that throws)
      throw;
    }
  }

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  ~CudaBackend() override { release(); }

  DeviceKind kind() const override { return DeviceKind::Cuda; }
  std::string name() const override { return name_; }
  bool host_accessible() const override { return false; }

  void copy_from_host(float* device_dst, const float* host_src, size_t count) override {
    if (count == 0) return;
    activate();
    PSGD_CUDA_CHECK(cudaMemcpyAsync(device_dst, host_src, count * sizeof(float), cudaMemcpyHostToDevice, stream_));
    // The contract lets the caller reuse host_src at once; with pinned memory the
    // copy would still be in flight, so wait.
    PSGD_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy_to_host(float* host_dst, const float* device_src, size_t count) override {
    if (count == 0) return;
    activate();
    PSGD_CUDA_CHECK(cudaMemcpyAsync(host_dst, device_src, count * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    PSGD_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy(float* device_dst, const float* device_src, size_t count) override {
    if (count == 0 || device_dst == device_src) return;
    activate();
    PSGD_CUDA_CHECK(cudaMemcpyAsync(device_dst, device_src, count * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  void fill(float* device_dst, float value, size_t count) override {
    activate();
    cuda::launch_fill(device_dst, value, count, stream_);
  }

  void add(float* y, const float* x, size_t count) override {
    activate();
    cuda::launch_add(y, x, count, stream_);
  }
  void scale(float* x, float alpha, size_t count) override {
    activate();
    cuda::launch_scale(x, alpha, count, stream_);
  }
  void subtract(float* out, const float* a, const float* b, size_t count) override {
    activate();
    cuda::launch_subtract(out, a, b, count, stream_);
  }

  double squared_norm(const float* x, size_t count) override {
    return read_back<double>([&](double* sum) { cuda::launch_squared_norm(x, count, sum, stream_); });
  }

  bool all_finite(const float* x, size_t count) override {
    return read_back<int>([&](int* flag) { cuda::launch_find_nonfinite(x, count, flag, stream_); }) == 0;
  }

  void gemm(Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
            int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float beta, float* c,
            int64_t ldc, int64_t stride_c, int64_t batch) override {
    detail::check_gemm_arguments(trans_a, trans_b, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc, stride_c,
                                 batch);
    if (m == 0 || n == 0 || batch == 0) return;
    activate();
    if (k == 0) {
      cuda::launch_scale_matrix(c, m, n, ldc, stride_c, batch, beta, stream_);
      return;
    }
    // cuBLAS is column-major: a row-major matrix is its column-major transpose,
    // so C^T = op(B)^T op(A)^T is computed with the operands swapped and the
    // transpose flags unchanged.
    if (batch == 1) {
      PSGD_CUDA_CHECK(cublasSgemm_64(cublas_, to_cublas(trans_b), to_cublas(trans_a), n, m, k, &alpha, b, ldb, a, lda,
                                     &beta, c, ldc));
    } else {
      PSGD_CUDA_CHECK(cublasSgemmStridedBatched_64(cublas_, to_cublas(trans_b), to_cublas(trans_a), n, m, k, &alpha, b,
                                                   ldb, stride_b, a, lda, stride_a, &beta, c, ldc, stride_c, batch));
    }
  }

  void orthogonalize(float* m, int64_t rows, int64_t cols, int64_t batch, int64_t stride, OrthoMethod method,
                     float epsilon, uint64_t seed) override {
    detail::check_orthogonalize_arguments(m, rows, cols, batch, stride, epsilon);
    if (rows == 0 || cols == 0 || batch == 0) return;
    activate();
    if (method == OrthoMethod::GramSchmidt)
      cuda::launch_gram_schmidt(m, rows, cols, batch, stride, epsilon, seed, stream_);
    else
      householder_qr(m, rows, cols, batch, stride, seed);
  }

  // The fused passes are compositions of the primitives above on this
  // backend: the GPU's memory bandwidth makes the extra passes cheap next to the
  // host's, and cuBLAS handles the skinny gemms without packing M.
  double form_and_project(float* m, const float* a, const float* b, int64_t rows, int64_t cols, const float* q,
                          int64_t rank, float* p) override {
    detail::check_fused_arguments("form_and_project", rows, cols, rank,
                                  {{"m", m, rows * cols}, {"a", a, rows * cols}, {"q", q, cols * rank},
                                   {"p", p, rows * rank}});
    const auto count = static_cast<size_t>(rows * cols);
    if (b != nullptr)
      subtract(m, a, b, count);
    else
      copy(m, a, count);
    gemm(Transpose::No, Transpose::No, rows, rank, cols, 1.0f, m, ld(cols), 0, q, ld(rank), 0, 0.0f, p, ld(rank), 0,
         1);
    return squared_norm(m, count);
  }

  void project_transposed(const float* m, int64_t rows, int64_t cols, const float* p, int64_t rank,
                          float* q) override {
    detail::check_fused_arguments("project_transposed", rows, cols, rank,
                                  {{"m", m, rows * cols}, {"p", p, rows * rank}, {"q", q, cols * rank}});
    gemm(Transpose::Yes, Transpose::No, cols, rank, rows, 1.0f, m, ld(cols), 0, p, ld(rank), 0, 0.0f, q, ld(rank), 0,
         1);
  }

  double reconstruct_and_residual(float* out, float* m, int64_t rows, int64_t cols, const float* p, const float* q,
                                  int64_t rank) override {
    detail::check_fused_arguments("reconstruct_and_residual", rows, cols, rank,
                                  {{"out", out, rows * cols}, {"m", m, rows * cols}, {"p", p, rows * rank},
                                   {"q", q, cols * rank}});
    gemm(Transpose::No, Transpose::Yes, rows, cols, rank, 1.0f, p, ld(rank), 0, q, ld(rank), 0, 0.0f, out, ld(cols),
         0, 1);
    gemm(Transpose::No, Transpose::Yes, rows, cols, rank, 1.0f, p, ld(rank), 0, q, ld(rank), 0, -1.0f, m, ld(cols), 0,
         1);
    return squared_norm(m, static_cast<size_t>(rows * cols));
  }

  void synchronize() override {
    activate();
    PSGD_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  // Runs a reduction kernel into the zeroed device scalar result_ and returns it
  // on the host; waits for the stream (the caller needs the value now).
  template <typename T, typename Launch>
  T read_back(Launch&& launch) {
    static_assert(sizeof(T) <= kResultBytes);
    activate();
    auto* result = static_cast<T*>(result_);
    PSGD_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(T), stream_));
    launch(result);
    T host{};
    PSGD_CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof(T), cudaMemcpyDeviceToHost, stream_));
    PSGD_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return host;
  }

 protected:
  float* allocate_raw(size_t count) override {
    activate();
    PSGD_REQUIRE(count <= SIZE_MAX / sizeof(float), InvalidArgumentError, "cuda backend: cannot allocate ", count,
                 " floats (size overflows)");
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, count * sizeof(float));
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the error so later calls do not report it again
      PSGD_THROW(IoError, "cuda backend: out of device memory allocating ", count, " floats (",
                 count * sizeof(float), " bytes) on device ", device_);
    }
    PSGD_CUDA_CHECK(status);
    // Zero-initialized per the contract; ordered before any later work on the stream.
    const cudaError_t zeroed = cudaMemsetAsync(ptr, 0, count * sizeof(float), stream_);
    if (zeroed != cudaSuccess) cudaFree(ptr);  // not leaked; the error is reported below
    PSGD_CUDA_CHECK(zeroed);
    return static_cast<float*>(ptr);
  }

  void deallocate_raw(float* ptr) noexcept override {
    // On this backend's device (the caller may be a thread with another current, which it keeps). cudaFree
    // waits for the device, so no pending kernel still uses ptr.
    const DeviceRestorer restore;
    if (const cudaError_t set = cudaSetDevice(device_); set != cudaSuccess)
      PSGD_LOG(Warn, "cuda backend: cudaSetDevice failed: ", cudaGetErrorName(set));
    const cudaError_t status = cudaFree(ptr);
    if (status != cudaSuccess)
      PSGD_LOG(Warn, "cuda backend: cudaFree failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
  }

 private:
  static constexpr size_t kResultBytes = 64;

  // The device may have been switched by other code on this thread.
  void activate() { PSGD_CUDA_CHECK(cudaSetDevice(device_)); }

  // Releases what exists, on this backend's device (the destroying thread may have another current, or none:
  // a call there would create a context on device 0). Never throws; reports and carries on.
  void release() noexcept {
    auto report = [](const char* what, int status) {
      if (status != 0) PSGD_LOG(Warn, "cuda backend teardown: ", what, " failed with status ", status);
    };
    const DeviceRestorer restore;  // the caller's current device afterwards
    report("cudaSetDevice", cudaSetDevice(device_));
    if (stream_ != nullptr) report("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
    if (result_ != nullptr) report("cudaFree", cudaFree(result_));
    if (cusolver_ != nullptr) report("cusolverDnDestroy", cusolverDnDestroy(cusolver_));
    if (cublas_ != nullptr) report("cublasDestroy", cublasDestroy(cublas_));
    if (stream_ != nullptr) report("cudaStreamDestroy", cudaStreamDestroy(stream_));
    result_ = nullptr;
    cusolver_ = nullptr;
    cublas_ = nullptr;
    stream_ = nullptr;
  }

  // cuSOLVER wants column-major: transpose each item into scratch (rows x cols
  // column-major == cols x rows row-major), geqrf, flag the degenerate
  // columns from R, orgqr (a rebuilt basis instead when a column was flagged),
  // zero the columns beyond min(rows, cols), transpose back.
  void householder_qr(float* m, int64_t rows, int64_t cols, int64_t batch, int64_t stride, uint64_t seed) {
    PSGD_REQUIRE(detail::fits_int32(rows * cols), InvalidArgumentError, "cuda backend: QR of a ", rows, " x ", cols,
                 " matrix exceeds cuSOLVER's 32-bit sizes");
    const int im = static_cast<int>(rows), in = static_cast<int>(cols), ik = std::min(im, in);
    const size_t elements = static_cast<size_t>(rows * cols);
    auto* a = static_cast<float*>(matrix_.get(elements * sizeof(float)));
    auto* tau = static_cast<float*>(tau_.get(static_cast<size_t>(ik) * sizeof(float)));
    auto* flags = static_cast<int*>(flags_.get(static_cast<size_t>(ik) * sizeof(int)));
    int lwork_geqrf = 0, lwork_orgqr = 0;
    PSGD_CUDA_CHECK(cusolverDnSgeqrf_bufferSize(cusolver_, im, in, a, im, &lwork_geqrf));
    PSGD_CUDA_CHECK(cusolverDnSorgqr_bufferSize(cusolver_, im, ik, ik, a, im, tau, &lwork_orgqr));
    const int lwork = std::max({1, lwork_geqrf, lwork_orgqr});
    auto* work = static_cast<float*>(work_.get(static_cast<size_t>(lwork) * sizeof(float)));
    // One geqrf and one orgqr info slot per item, checked once after the batch.
    const size_t info_bytes = 2 * static_cast<size_t>(batch) * sizeof(int);
    auto* info = static_cast<int*>(info_.get(info_bytes));
    PSGD_CUDA_CHECK(cudaMemsetAsync(info, 0, info_bytes, stream_));
    for (int64_t item = 0; item < batch; ++item) {
      float* matrix = m + item * stride;
      cuda::launch_transpose(a, matrix, rows, cols, stream_);
      int* item_info = info + 2 * item;
      PSGD_CUDA_CHECK(cusolverDnSgeqrf(cusolver_, im, in, a, im, tau, work, lwork, item_info));
      cuda::launch_flag_degenerate(a, im, ik, flags, stream_);
      PSGD_CUDA_CHECK(cusolverDnSorgqr(cusolver_, im, ik, ik, a, im, tau, work, lwork, item_info + 1));
      cuda::launch_rebuild_if_degenerate(matrix, rows, cols, a, ik, flags, seed, item, stream_);
      if (ik < in)
        PSGD_CUDA_CHECK(cudaMemsetAsync(a + static_cast<size_t>(ik) * static_cast<size_t>(im), 0,
                                        static_cast<size_t>(in - ik) * static_cast<size_t>(im) * sizeof(float), stream_));
      cuda::launch_transpose(matrix, a, cols, rows, stream_);
    }
    // devInfo < 0 means an invalid argument: a bug in this backend, not bad data.
    // Reading it makes QR synchronous, which the PowerSGD step tolerates (the
    // next allreduce waits for the result anyway).
    std::vector<int> host(2 * static_cast<size_t>(batch));
    PSGD_CUDA_CHECK(cudaMemcpyAsync(host.data(), info, info_bytes, cudaMemcpyDeviceToHost, stream_));
    PSGD_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (size_t i = 0; i < host.size(); ++i)
      PSGD_ASSERT(host[i] == 0, "cuSOLVER ", i % 2 == 0 ? "geqrf" : "orgqr", " of batch item ", i / 2,
                  " returned info=", host[i]);
  }

  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cusolverDnHandle_t cusolver_ = nullptr;
  void* result_ = nullptr;
  Scratch matrix_, tau_, work_, info_, flags_;
};

}  // namespace

namespace cuda {

int device_count(std::string* reason) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess && count > 0) return count;
  cudaGetLastError();  // clear the error so later calls do not report it again
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  if (status == cudaErrorInsufficientDriver)
    *reason = powersgd::detail::concat(
        "no NVIDIA driver for the CUDA ", runtime / 1000, ".", runtime % 1000 / 10,
        " runtime (cudaErrorInsufficientDriver: libcuda.so.1 missing or older than the runtime); install the NVIDIA "
        "driver, or run on a GPU host");
  else if (status == cudaSuccess || status == cudaErrorNoDevice)
    *reason = "no CUDA device on this host (cudaErrorNoDevice); check nvidia-smi and CUDA_VISIBLE_DEVICES";
  else
    *reason = powersgd::detail::concat("cudaGetDeviceCount failed: ", cudaGetErrorName(status), " (",
                                       cudaGetErrorString(status), "); check nvidia-smi");
  return 0;
}

std::unique_ptr<Backend> make_backend(int device_index) {
  std::string reason;
  const int count = device_count(&reason);
  PSGD_REQUIRE(count > 0, UnsupportedError, "CUDA backend unavailable: missing a GPU: ", reason);
  PSGD_REQUIRE(device_index >= 0 && device_index < count, InvalidArgumentError, "CUDA device index ", device_index,
               " out of range: expected 0 to ", count - 1);
  return std::make_unique<CudaBackend>(device_index);
}

}  // namespace cuda

}  // namespace powersgd::compute
