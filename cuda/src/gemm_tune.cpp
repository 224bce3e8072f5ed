// The GEMM autotuner: times cublasGemmEx (what an untuned gemm runs, the call torch.matmul
// makes), cuBLASLt's candidates and, for the few-row problems it takes, inferctx's own kernel
// (gemm_gemv.cu) on random operands, keeps the fastest whose result matches cublasGemmEx's, and
// caches it.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/gemm.hpp"
#include "inferctx/memory.hpp"
#include "inferctx/pool.hpp"
#include "inferctx/stream.hpp"
#include "gemm_detail.hpp"

namespace inferctx {

using namespace detail;

namespace {

// cuBLASLt's candidates for a choice's problem, best estimate first, keeping those that succeed
// within the handle's workspace. Empty when cuBLASLt has none for this configuration.
std::vector<cublasLtMatmulHeuristicResult_t> heuristic(const CublasHandle& handle, const AlgoChoice& choice,
                                                       int align_a, int align_b, int align_c, int count) {
  const int device = handle.device();
  cublasLtMatmulPreferenceOpaque_t pref;
  check_cublas(cublasLtMatmulPreferenceInit(&pref), "cublasLtMatmulPreferenceInit", device);
  const uint64_t workspace = static_cast<uint64_t>(handle.workspace_bytes());
  check_cublas(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                    sizeof workspace),
               "cublasLtMatmulPreferenceSetAttribute(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)", device);
  // cuBLASLt's A is our B and its B our A.
  const uint32_t aligns[4] = {static_cast<uint32_t>(align_b), static_cast<uint32_t>(align_a),
                              static_cast<uint32_t>(align_c), static_cast<uint32_t>(align_c)};
  const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    check_cublas(cublasLtMatmulPreferenceSetAttribute(&pref, attrs[i], &aligns[i], sizeof aligns[i]),
                 "cublasLtMatmulPreferenceSetAttribute(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES)", device);
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(count));
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle.lt(), choice.op(), choice.lt_a(), choice.lt_b(),
                                                               choice.lt_c(), choice.lt_c(), &pref, count,
                                                               results.data(), &returned);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return {};
  check_cublas(status, "cublasLtMatmulAlgoGetHeuristic", device);
  std::vector<cublasLtMatmulHeuristicResult_t> usable;
  for (int i = 0; i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace) usable.push_back(results[i]);
  }
  return usable;
}

template <typename T>
T algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof value, &written) != CUBLAS_STATUS_SUCCESS) {
    return T{};
  }
  return value;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Relative Frobenius distance allowed between a candidate's result and the default's: both
// accumulate in fp32, so they differ by summation order and the output's rounding.
double tune_tolerance(const GemmProblem& p) {
  switch (p.dtype) {
    case 0: return uses_tf32(p) ? 5e-3 : 1e-4;
    case 1: return 1e-2;
    default: return 2e-2;
  }
}

uint64_t fresh_seed() {
  static std::atomic<uint64_t> counter{0};
  std::random_device device;
  const uint64_t entropy = (static_cast<uint64_t>(device()) << 32) ^ device();
  return entropy ^ (0x9e3779b97f4a7c15ull * ++counter);
}

}  // namespace

GemmTuneResult tune_gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem,
                         const GemmTuneOptions& options) {
  require_explicit_stream(stream, "tune_gemm");
  validate_gemm(problem);
  if (problem.m < 1 || problem.n < 1 || problem.k < 1 || problem.batch < 1) {
    reject("m", "tuning needs m, n, k and batch >= 1; got m " + str(problem.m) + ", n " + str(problem.n) + ", k " +
                    str(problem.k) + ", batch " + str(problem.batch));
  }
  if (options.max_algorithms < 1 || options.max_algorithms > 256) {
    reject("max_algorithms", "got " + str(options.max_algorithms) + "; valid: 1..256");
  }
  if (options.warmup < 0) reject("warmup", "got " + str(options.warmup) + "; must be >= 0");
  if (options.repeats < 1) reject("repeats", "got " + str(options.repeats) + "; must be >= 1");
  if (!(options.min_batch_ms > 0.0) || !std::isfinite(options.min_batch_ms)) {
    reject("min_batch_ms", "got " + std::to_string(options.min_batch_ms) + "; must be > 0");
  }

  const GemmProblem p = normalized(problem);
  const int device = handle.device();
  CurrentDeviceScope scope(device);
  const int64_t es = dtype_size(p.dtype);
  const int64_t span_a = span_elements("lda", "stride_a", stored_a(p), p.lda, p.batch, p.stride_a, es);
  const int64_t span_b = span_elements("ldb", "stride_b", stored_b(p), p.ldb, p.batch, p.stride_b, es);
  const int64_t span_c = span_elements("ldc", "stride_c", Stored{p.m, p.n}, p.ldc, p.batch, p.stride_c, es);
  const int64_t bytes_ab = (span_a + span_b) * es;
  const int64_t bytes_c = span_c * es;

  // Enough copies of A and B that cycling through them defeats L2, as the inputs of a real
  // model's successive layers would; bounded by a quarter of free memory.
  int l2_bytes = 0, clock_khz = 0;
  check_cuda(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device), "cudaDeviceGetAttribute", device);
  check_cuda(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device), "cudaDeviceGetAttribute", device);
  if (clock_khz <= 0) clock_khz = 2000000;
  int64_t sets = std::max<int64_t>(1, (3 * static_cast<int64_t>(l2_bytes) + bytes_ab - 1) / std::max<int64_t>(bytes_ab, 1));
  sets = std::min<int64_t>(sets, 64);
  const int64_t free_bytes = memory_info(device).free_bytes;
  while (sets > 1 && sets * bytes_ab + 2 * bytes_c > free_bytes / 4) --sets;

  // Temporaries come from the device's stream-ordered pool, on the tuning stream.
  WorkspaceUse use(handle, stream);
  if (use.capturing()) reject("stream", "tune_gemm cannot run while the stream is captured into a CUDA graph; tune before capturing");
  const std::shared_ptr<DevicePool> pool = DevicePool::of(device);
  std::vector<std::shared_ptr<PooledAllocation>> a_sets, b_sets;
  for (int64_t s = 0; s < sets; ++s) {
    a_sets.push_back(pool->allocate(span_a * es, stream));
    b_sets.push_back(pool->allocate(span_b * es, stream));
  }
  const std::shared_ptr<PooledAllocation> c_ref_memory = pool->allocate(bytes_c, stream);
  const std::shared_ptr<PooledAllocation> c_try_memory = pool->allocate(bytes_c, stream);
  const std::shared_ptr<PooledAllocation> sums_memory = pool->allocate(static_cast<int64_t>(sizeof(CompareSums)), stream);
  DeviceAllocation& c_ref = *c_ref_memory;
  DeviceAllocation& c_try = *c_try_memory;
  auto* sums = static_cast<CompareSums*>(sums_memory->data());
  const uint64_t seed = fresh_seed();
  for (int64_t s = 0; s < sets; ++s) {
    launch_fill(p.dtype, a_sets[s]->data(), span_a, seed + 2 * static_cast<uint64_t>(s), stream, device);
    launch_fill(p.dtype, b_sets[s]->data(), span_b, seed + 2 * static_cast<uint64_t>(s) + 1, stream, device);
  }
  const int align_a = alignment_of(a_sets[0]->data(), p.batch, p.stride_a, es);
  const int align_b = alignment_of(b_sets[0]->data(), p.batch, p.stride_b, es);
  const int align_c = alignment_of(c_ref.data(), p.batch, p.stride_c, es);

  struct Candidate {
    GemmBackend backend;
    cublasLtMatmulAlgo_t algo;
    size_t workspace_bytes;
    int index;  // 0: cublasGemmEx, the untuned default; then cuBLASLt's candidates; then Gemv
    bool valid;
    int runs;   // per timed batch
    double ms;
  };
  std::shared_ptr<AlgoChoice> base = new_choice(p, device);
  const auto listed = heuristic(handle, *base, align_a, align_b, align_c, options.max_algorithms);
  std::vector<Candidate> cands;
  cublasLtMatmulAlgo_t no_algo;
  std::memset(&no_algo, 0, sizeof no_algo);
  // First, the reference and the baseline: what gemm runs untuned (heuristic_choice).
  cands.push_back({GemmBackend::Cublas, no_algo, 0, 0, false, 1, 0.0});
  for (const auto& r : listed) {
    cands.push_back({GemmBackend::CublasLt, r.algo, r.workspaceSize, static_cast<int>(cands.size()), false, 1, 0.0});
  }
  if (gemv_runs(p, align_b, handle.bound_workspace_bytes())) {
    cands.push_back({GemmBackend::Gemv, no_algo, gemv_workspace_bytes(p), static_cast<int>(cands.size()), false, 1, 0.0});
  }

  const float one = 1.0f, zero = 0.0f;
  auto run = [&](const Candidate& cand, int64_t set, void* out) -> cublasStatus_t {
    const void* a = a_sets[static_cast<size_t>(set)]->data();
    const void* b = b_sets[static_cast<size_t>(set)]->data();
    if (cand.backend == GemmBackend::Cublas) return run_cublas(handle, p, a, b, out, &one, &zero);
    if (cand.backend == GemmBackend::Gemv) {
      launch_gemv(p, a, b, out, one, zero, handle.bound_workspace(), stream, device);
      return CUBLAS_STATUS_SUCCESS;
    }
    return run_lt(handle, stream, *base, &cand.algo, a, b, out, &one, &zero);
  };
  auto compare = [&](const void* x, const void* y) -> CompareSums {
    check_cuda(cudaMemsetAsync(sums, 0, sizeof(CompareSums), stream), "cudaMemsetAsync", device);
    launch_compare(p, x, y, sums, stream, device);
    CompareSums host;
    check_cuda(cudaMemcpyAsync(&host, sums, sizeof host, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync", device);
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize", device);
    return host;
  };
  // 0xFF bytes are NaN in all three dtypes: an element a candidate fails to write shows up.
  auto poison = [&](void* out) {
    check_cuda(cudaMemsetAsync(out, 0xFF, static_cast<size_t>(bytes_c), stream), "cudaMemsetAsync", device);
  };

  // The reference is what gemm computes untuned (cublasGemmEx, torch's bits).
  poison(c_ref.data());
  check_cublas(run(cands[0], 0, c_ref.data()), cublas_call_name(p), device);
  if (compare(c_ref.data(), c_ref.data()).nonfinite != 0) {
    const std::string call = std::string(cublas_call_name(p)) +
                             " (tune_gemm: the untuned default left non-finite values on random inputs)";
    throw_cublas_error(CUBLAS_STATUS_EXECUTION_FAILED, call.c_str(), device);
  }
  const double tolerance = tune_tolerance(p);
  for (Candidate& cand : cands) {
    poison(c_try.data());
    if (run(cand, 0, c_try.data()) != CUBLAS_STATUS_SUCCESS) continue;
    const CompareSums s = compare(c_try.data(), c_ref.data());
    if (s.nonfinite != 0) continue;
    const double error = s.ref2 > 0.0 ? std::sqrt(s.diff2 / s.ref2) : std::sqrt(s.diff2);
    cand.valid = error <= tolerance;
  }

  std::vector<std::unique_ptr<Event>> starts, ends;
  auto events = [&](size_t n) {
    while (starts.size() < n) {
      starts.push_back(std::make_unique<Event>(device, true));
      ends.push_back(std::make_unique<Event>(device, true));
    }
  };
  int64_t rotation = 0;
  // Launching costs the host a few microseconds per run: the spin covers that, so the GPU
  // runs the batch back to back.
  auto timed_batch = [&](const Candidate& cand, size_t slot) -> bool {
    const double spin_us = std::min(20000.0, 8.0 * cand.runs + 20.0);
    launch_spin(static_cast<long long>(spin_us * clock_khz / 1000.0), stream, device);
    starts[slot]->record(stream);
    for (int r = 0; r < cand.runs; ++r) {
      if (run(cand, rotation++ % sets, c_try.data()) != CUBLAS_STATUS_SUCCESS) return false;
    }
    ends[slot]->record(stream);
    return true;
  };
  auto batch_ms = [&](const Candidate& cand, size_t slot) {
    return static_cast<double>(ends[slot]->elapsed_ms_since(*starts[slot])) / cand.runs;
  };

  // Round 1: every valid candidate, median of `repeats` batches.
  events(static_cast<size_t>(options.repeats));
  for (Candidate& cand : cands) {
    if (!cand.valid) continue;
    for (int w = 0; w < options.warmup && cand.valid; ++w) {
      cand.valid = run(cand, rotation++ % sets, c_try.data()) == CUBLAS_STATUS_SUCCESS;
    }
    cand.runs = 1;
    if (!cand.valid || !timed_batch(cand, 0)) {
      cand.valid = false;
      continue;
    }
    ends[0]->synchronize();
    const double once = std::max(batch_ms(cand, 0), 1e-4);
    cand.runs = static_cast<int>(std::min(1000.0, std::max(1.0, std::ceil(options.min_batch_ms / once))));
    std::vector<double> times;
    for (int r = 0; r < options.repeats && cand.valid; ++r) cand.valid = timed_batch(cand, static_cast<size_t>(r));
    if (!cand.valid) continue;
    ends[static_cast<size_t>(options.repeats - 1)]->synchronize();
    for (int r = 0; r < options.repeats; ++r) times.push_back(batch_ms(cand, static_cast<size_t>(r)));
    cand.ms = median(times);
  }
  int valid = 0;
  for (const Candidate& cand : cands) valid += cand.valid ? 1 : 0;
  if (valid == 0) {
    throw_cublas_error(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmul (tune_gemm: no candidate algorithm ran correctly)",
                       device);
  }

  // Round 2: the default and the three fastest others, interleaved so that clock and
  // thermal drift fall on all of them alike.
  std::vector<size_t> order;
  for (size_t i = 1; i < cands.size(); ++i) {
    if (cands[i].valid) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cands[x].ms < cands[y].ms; });
  std::vector<size_t> finalists;
  if (cands[0].valid) finalists.push_back(0);
  for (size_t i = 0; i < order.size() && i < 3; ++i) finalists.push_back(order[i]);
  const int rounds = std::max(options.repeats, 5);
  events(finalists.size() * static_cast<size_t>(rounds));
  std::vector<bool> ran(finalists.size(), true);
  for (int r = 0; r < rounds; ++r) {
    for (size_t f = 0; f < finalists.size(); ++f) {
      if (ran[f]) ran[f] = timed_batch(cands[finalists[f]], static_cast<size_t>(r) * finalists.size() + f);
    }
  }
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize", device);
  size_t winner = finalists.front();
  double best_ms = INFINITY, default_ms = -1.0;
  for (size_t f = 0; f < finalists.size(); ++f) {
    if (!ran[f]) continue;
    std::vector<double> times;
    for (int r = 0; r < rounds; ++r) {
      times.push_back(batch_ms(cands[finalists[f]], static_cast<size_t>(r) * finalists.size() + f));
    }
    const double ms = median(times);
    if (finalists[f] == 0) default_ms = ms;
    if (ms < best_ms) {
      best_ms = ms;
      winner = finalists[f];
    }
  }
  if (!std::isfinite(best_ms)) {
    throw_cublas_error(CUBLAS_STATUS_EXECUTION_FAILED, "cublasLtMatmul (tune_gemm: timing runs failed)", device);
  }
  if (winner != 0 && default_ms > 0.0 && best_ms > default_ms * (1.0 - kTuneMinGain)) {
    winner = 0;  // not clearly faster: cublasGemmEx stays
    best_ms = default_ms;
  }

  const Candidate& win = cands[winner];
  std::shared_ptr<AlgoChoice> tuned = new_choice(p, device);
  tuned->backend = win.backend;
  tuned->algo = win.algo;
  tuned->workspace_bytes = win.workspace_bytes;
  tuned->source = Source::Tuned;
  tuned->time_ms = best_ms;
  tuned->verified = true;
  store_choice(make_key(device, p, align_a, align_b, align_c), std::move(tuned));

  GemmTuneResult result;
  result.backend = static_cast<int>(win.backend);
  result.algo_index = win.index;
  if (win.backend == GemmBackend::CublasLt) {  // the others have no cuBLASLt configuration
    result.algo = algo_words(win.algo);
    result.algo_id = algo_config<int32_t>(win.algo, CUBLASLT_ALGO_CONFIG_ID);
    result.tile_id = static_cast<int>(algo_config<uint32_t>(win.algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
    result.stages_id = static_cast<int>(algo_config<uint32_t>(win.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID));
    result.splitk = algo_config<int32_t>(win.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  }
  result.default_ms = default_ms;
  result.best_ms = best_ms;
  result.candidates = static_cast<int>(cands.size());
  result.valid = valid;
  result.rotated_sets = static_cast<int>(sets);
  return result;
}

}  // namespace inferctx
