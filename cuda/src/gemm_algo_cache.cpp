// The process-wide cache of the algorithm chosen for each GEMM problem: its keys, the choice
// made for a problem seen for the first time, the check of an imported algorithm, and the
// export and import of entries as plain data.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/gemm.hpp"
#include "gemm_detail.hpp"

namespace inferctx {

using namespace detail;

namespace {

std::string device_name(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = names.find(device);
  if (it != names.end()) return it->second;
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties", device);
  return names.emplace(device, prop.name).first->second;
}

int64_t cublas_lt_version() { return static_cast<int64_t>(cublasLtGetVersion()); }

struct KeyHash {
  size_t operator()(const Key& key) const noexcept {
    uint64_t h = 0x84222325cbf29ce4ull;
    for (int64_t x : key.v) {
      h ^= static_cast<uint64_t>(x) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

GemmProblem problem_of(const Key& key) {
  GemmProblem p;
  p.dtype = static_cast<int>(key.v[Key::DTypeF]);
  p.trans_a = key.v[Key::TransA] != 0;
  p.trans_b = key.v[Key::TransB] != 0;
  p.tf32 = key.v[Key::Tf32] != 0;
  p.m = key.v[Key::M];
  p.n = key.v[Key::N];
  p.k = key.v[Key::K];
  p.batch = key.v[Key::Batch];
  p.lda = key.v[Key::Lda];
  p.ldb = key.v[Key::Ldb];
  p.ldc = key.v[Key::Ldc];
  p.stride_a = key.v[Key::StrideA];
  p.stride_b = key.v[Key::StrideB];
  p.stride_c = key.v[Key::StrideC];
  return p;
}

void init_layout(cublasLtMatrixLayoutOpaque_t* storage, cudaDataType_t type, Stored s, int64_t ld, int64_t batch,
                 int64_t stride, int device) {
  // Row-major r x c is column-major c x r with the same leading dimension.
  check_cublas(cublasLtMatrixLayoutInit(storage, type, static_cast<uint64_t>(s.cols), static_cast<uint64_t>(s.rows), ld),
               "cublasLtMatrixLayoutInit", device);
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    check_cublas(cublasLtMatrixLayoutSetAttribute(storage, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
                 "cublasLtMatrixLayoutSetAttribute(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT)", device);
    check_cublas(cublasLtMatrixLayoutSetAttribute(storage, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof stride),
                 "cublasLtMatrixLayoutSetAttribute(CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET)", device);
  }
}

struct AlgoCache {
  std::mutex mutex;
  std::unordered_map<Key, std::shared_ptr<const AlgoChoice>, KeyHash> choices;
  size_t heuristic_entries = 0;  // choices whose source is Source::Heuristic
};

AlgoCache& algo_cache() {
  static AlgoCache* cache = new AlgoCache();  // never destroyed: usable from other statics' destructors
  return *cache;
}

}  // namespace

namespace detail {

Key make_key(int device, const GemmProblem& p, int align_a, int align_b, int align_c) {
  Key key;
  key.v[Key::Device] = device;
  key.v[Key::DTypeF] = p.dtype;
  key.v[Key::TransA] = p.trans_a;
  key.v[Key::TransB] = p.trans_b;
  key.v[Key::Tf32] = p.tf32;
  key.v[Key::M] = p.m;
  key.v[Key::N] = p.n;
  key.v[Key::K] = p.k;
  key.v[Key::Batch] = p.batch;
  key.v[Key::Lda] = p.lda;
  key.v[Key::Ldb] = p.ldb;
  key.v[Key::Ldc] = p.ldc;
  key.v[Key::StrideA] = p.stride_a;
  key.v[Key::StrideB] = p.stride_b;
  key.v[Key::StrideC] = p.stride_c;
  key.v[Key::AlignA] = align_a;
  key.v[Key::AlignB] = align_b;
  key.v[Key::AlignC] = align_c;
  return key;
}


std::shared_ptr<AlgoChoice> new_choice(const GemmProblem& p, int device) {
  auto choice = std::make_shared<AlgoChoice>();
  std::memset(&choice->algo, 0, sizeof choice->algo);
  check_cublas(cublasLtMatmulDescInit(&choice->op_storage, compute_type(p), CUDA_R_32F), "cublasLtMatmulDescInit",
               device);
  const int32_t op_lt_a = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t op_lt_b = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_cublas(
      cublasLtMatmulDescSetAttribute(&choice->op_storage, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a, sizeof op_lt_a),
      "cublasLtMatmulDescSetAttribute(CUBLASLT_MATMUL_DESC_TRANSA)", device);
  check_cublas(
      cublasLtMatmulDescSetAttribute(&choice->op_storage, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b, sizeof op_lt_b),
      "cublasLtMatmulDescSetAttribute(CUBLASLT_MATMUL_DESC_TRANSB)", device);
  const cudaDataType_t type = data_type(p.dtype);
  init_layout(&choice->lt_a_storage, type, stored_b(p), p.ldb, p.batch, p.stride_b, device);
  init_layout(&choice->lt_b_storage, type, stored_a(p), p.lda, p.batch, p.stride_a, device);
  init_layout(&choice->lt_c_storage, type, Stored{p.m, p.n}, p.ldc, p.batch, p.stride_c, device);
  return choice;
}

// The choice gemm uses for a problem seen for the first time: cublasGemmEx (or its strided
// batched form), the call torch.matmul makes, so that an untuned product takes the algorithm
// torch's takes and gives its bits. autotune_gemm replaces it with the fastest correct
// candidate, cuBLASLt's included.
std::shared_ptr<AlgoChoice> heuristic_choice(const CublasHandle& handle, const GemmProblem& p, int align_a,
                                             int align_b, int align_c) {
  (void)align_a;
  (void)align_b;
  (void)align_c;
  std::shared_ptr<AlgoChoice> choice = new_choice(p, handle.device());
  choice->backend = GemmBackend::Cublas;
  choice->source = Source::Heuristic;
  choice->verified = true;
  return choice;
}

std::shared_ptr<const AlgoChoice> find_choice(const Key& key) {
  AlgoCache& cache = algo_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  auto it = cache.choices.find(key);
  return it == cache.choices.end() ? nullptr : it->second;
}

namespace {

// store_choice with cache.mutex held.
void store_locked(AlgoCache& cache, const Key& key, std::shared_ptr<const AlgoChoice> choice) {
  const bool heuristic = choice->source == Source::Heuristic;
  auto it = cache.choices.find(key);
  if (it != cache.choices.end()) {
    if (it->second->source == Source::Heuristic) --cache.heuristic_entries;
    it->second = std::move(choice);
  } else {
    if (heuristic && cache.heuristic_entries >= kHeuristicEntryLimit) {
      // Every call signature seen (a prompt length, an offset view) leaves one: a long-running
      // process would grow without end. They are cheap to make again; tuned and imported
      // choices stay.
      for (auto e = cache.choices.begin(); e != cache.choices.end();) {
        e = e->second->source == Source::Heuristic ? cache.choices.erase(e) : std::next(e);
      }
      cache.heuristic_entries = 0;
    }
    cache.choices.emplace(key, std::move(choice));
  }
  if (heuristic) ++cache.heuristic_entries;
}

}  // namespace

void store_choice(const Key& key, std::shared_ptr<const AlgoChoice> choice) {
  AlgoCache& cache = algo_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  store_locked(cache, key, std::move(choice));
}

std::shared_ptr<const AlgoChoice> store_choice_if(const Key& key, const AlgoChoice* expected,
                                                  std::shared_ptr<const AlgoChoice> choice) {
  AlgoCache& cache = algo_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  auto it = cache.choices.find(key);
  const AlgoChoice* current = it == cache.choices.end() ? nullptr : it->second.get();
  if (current != expected) return current != nullptr ? it->second : choice;
  store_locked(cache, key, choice);
  return choice;
}

std::shared_ptr<const AlgoChoice> verify_imported(const CublasHandle& handle, const Key& key, const GemmProblem& p,
                                                  const AlgoChoice& imported) {
  const int device = handle.device();
  std::shared_ptr<AlgoChoice> choice = new_choice(p, device);
  bool usable = false;
  size_t workspace_bytes = 0;
  if (imported.backend == GemmBackend::Gemv) {
    // inferctx's kernel: where it takes the problem and the handle's workspace holds its sums.
    workspace_bytes = gemv_workspace_bytes(p);
    usable = gemv_runs(p, static_cast<int>(key.v[Key::AlignB]), handle.workspace_bytes());
  } else {
    cublasLtMatmulHeuristicResult_t check_result;
    std::memset(&check_result, 0, sizeof check_result);
    const cublasStatus_t status = cublasLtMatmulAlgoCheck(handle.lt(), choice->op(), choice->lt_a(), choice->lt_b(),
                                                          choice->lt_c(), choice->lt_c(), &imported.algo,
                                                          &check_result);
    workspace_bytes = check_result.workspaceSize;
    usable = status == CUBLAS_STATUS_SUCCESS && workspace_bytes <= static_cast<size_t>(handle.workspace_bytes());
  }
  if (usable) {
    choice->backend = imported.backend;
    choice->algo = imported.algo;
    choice->workspace_bytes = workspace_bytes;
    choice->source = Source::Imported;
    choice->time_ms = imported.time_ms;
    choice->verified = true;
  } else {
    choice = heuristic_choice(handle, p, static_cast<int>(key.v[Key::AlignA]), static_cast<int>(key.v[Key::AlignB]),
                              static_cast<int>(key.v[Key::AlignC]));
  }
  // Not over an entry another thread stored meanwhile (a tuning, a newer import).
  return store_choice_if(key, &imported, std::move(choice));
}

std::vector<uint64_t> algo_words(const cublasLtMatmulAlgo_t& algo) {
  std::vector<uint64_t> words(kAlgoWords);
  std::memcpy(words.data(), &algo, sizeof algo);
  return words;
}

}  // namespace detail

std::vector<GemmCacheEntry> export_gemm_cache(bool tuned_only) {
  std::vector<std::pair<Key, std::shared_ptr<const AlgoChoice>>> snapshot;
  {
    AlgoCache& cache = algo_cache();
    std::lock_guard<std::mutex> lock(cache.mutex);
    snapshot.assign(cache.choices.begin(), cache.choices.end());
  }
  std::vector<GemmCacheEntry> entries;
  for (const auto& [key, choice] : snapshot) {
    if (tuned_only && choice->source == Source::Heuristic) continue;
    GemmCacheEntry e;
    e.device = static_cast<int>(key.v[Key::Device]);
    e.device_name = device_name(e.device);
    e.cublas_version = cublas_lt_version();
    e.problem = problem_of(key);
    e.align_a = static_cast<int>(key.v[Key::AlignA]);
    e.align_b = static_cast<int>(key.v[Key::AlignB]);
    e.align_c = static_cast<int>(key.v[Key::AlignC]);
    e.backend = static_cast<int>(choice->backend);
    if (choice->backend == GemmBackend::CublasLt) e.algo = algo_words(choice->algo);
    e.time_ms = choice->time_ms;
    entries.push_back(std::move(e));
  }
  return entries;
}

namespace {

void check_entry(const GemmCacheEntry& e) {
  validate_gemm(e.problem);
  if (e.problem.m < 1 || e.problem.n < 1 || e.problem.k < 1 || e.problem.batch < 1) {
    reject("problem", "a cache entry needs m, n, k and batch >= 1; got m " + str(e.problem.m) + ", n " +
                          str(e.problem.n) + ", k " + str(e.problem.k) + ", batch " + str(e.problem.batch));
  }
  if (e.device < 0) reject("device", "got " + str(e.device) + "; device ordinals are >= 0");
  if (e.backend != static_cast<int>(GemmBackend::CublasLt) && e.backend != static_cast<int>(GemmBackend::Cublas) &&
      e.backend != static_cast<int>(GemmBackend::Gemv)) {
    reject("backend", "got " + str(e.backend) + "; valid: 0 (cublasLt), 1 (cublas), 2 (gemv)");
  }
  if (e.backend == static_cast<int>(GemmBackend::CublasLt) && e.algo.size() != kAlgoWords) {
    reject("algo", "got " + str(static_cast<int64_t>(e.algo.size())) + " words; a cuBLASLt algorithm has 8");
  }
  const std::pair<const char*, int> aligns[3] = {{"align_a", e.align_a}, {"align_b", e.align_b}, {"align_c", e.align_c}};
  for (const auto& [field, value] : aligns) {
    if (value < 1 || value > kMaxAlignment || (value & (value - 1)) != 0) {
      reject(field, "got " + str(value) + "; an alignment is a power of two from 1 to 256");
    }
  }
}

}  // namespace

void check_gemm_cache(const std::vector<GemmCacheEntry>& entries) {
  for (size_t i = 0; i < entries.size(); ++i) {
    try {
      check_entry(entries[i]);
    } catch (const ConfigError& e) {
      // Which entry of the file (or list) it is, so that it can be found and mended.
      throw ConfigError(e.argument, "entry " + std::to_string(i) + ": " + e.what());
    }
  }
}

int64_t import_gemm_cache(const std::vector<GemmCacheEntry>& entries) {
  check_gemm_cache(entries);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  const int64_t version = cublas_lt_version();
  int64_t accepted = 0;
  for (const GemmCacheEntry& e : entries) {
    if (e.device >= count || e.cublas_version != version || e.device_name != device_name(e.device)) continue;
    const GemmProblem p = normalized(e.problem);
    std::shared_ptr<AlgoChoice> choice = new_choice(p, e.device);
    choice->backend = static_cast<GemmBackend>(e.backend);
    if (choice->backend == GemmBackend::CublasLt) std::memcpy(&choice->algo, e.algo.data(), sizeof choice->algo);
    choice->source = Source::Imported;
    choice->time_ms = e.time_ms;
    choice->verified = choice->backend == GemmBackend::Cublas;  // the others: verify_imported
    store_choice(make_key(e.device, p, e.align_a, e.align_b, e.align_c), std::move(choice));
    ++accepted;
  }
  return accepted;
}

void clear_gemm_cache() {
  AlgoCache& cache = algo_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.choices.clear();
  cache.heuristic_entries = 0;
}

int64_t gemm_cache_size() {
  AlgoCache& cache = algo_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return static_cast<int64_t>(cache.choices.size());
}

}  // namespace inferctx
