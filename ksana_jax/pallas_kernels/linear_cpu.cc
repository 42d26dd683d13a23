// Small-batch linear layers for CPUs, an XLA FFI custom call:
//     y_i f32[R, O_i] = x f32[R, I] . W_i[O_i, I]^T   for one or several weights W_i
// for W in float32, bfloat16, int8 (w = values * scales, one scale per output row or per
// group of I / G columns) or int4 (w = q * scale + min per group of 32, GGUF Q4_1 packing:
// byte j of a group holds element j in its low nibble and element j + 16 in its high one).
//
// Built at first use by linear_cpu.py (cpu_build.py: g++ -O3 -march=native). At decode's
// few rows a product is bound by the weight bytes; XLA:CPU streams them well below the
// machine's bandwidth (a library call per product, one thread for a small one).
//
// Work items: disjoint ranges of weight rows (output features), spread over XLA's intra-op
// thread pool for a large W (parallel_bytes), so every core streams its own part of W, each
// weight byte read once. An item walks its rows kOutBlock at a time. The direct paths --
// bfloat16 (vdpbf16ps), float32 (FMA), int4 in a bfloat16 product at any rows (Q4_1's
// algebra: the 4-bit values go to vdpbf16ps as exact bfloat16 1 + q / 16, the scales and
// minimums are applied per group after the dot; tile_dot_int4_bf16), and int8 / int4 in a
// float32 product at up to kRowTile rows -- multiply the block's rows straight from memory
// (dequantized in registers), prefetching kPrefetchRows ahead. Otherwise (int8 at more
// rows, int4 in a float32 product at more rows, or no AVX512-BF16) each block goes kChunk
// columns at a time:
//   phase 1  dequantize the block's chunk to float32 in registers (bfloat16 by a shift,
//            int8 / int4 by a convert and a multiply-add), stored to an L1 scratch;
//   phase 2  for every kRowTile of x's rows (read from L1 / L2), a register tile of
//            kRowTile x kOutBlock float32 vector accumulators, summed across lanes at the
//            end of the chunk.
// Several weights that share x (q/k/v, gate/up) go in one call, one XLA thunk: their rows
// form one list of work items, and "a large W" is their bytes together
// reaching the call's attribute parallel_bytes (linear_cpu.PARALLEL_BYTES).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif  // vdpbf16ps needs -march with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids)

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;     // floats per vector (one AVX-512 register, two AVX2 ones)
constexpr int kOutBlock = 4;   // weight rows per register tile
// The direct paths prefetch the weight rows this far ahead (a prefetch past W's end is
// dropped: it does not fault).
constexpr int kPrefetchRows = 2 * kOutBlock;
constexpr int kChunk = 512;    // columns dequantized at a time (a multiple of 32)
#if defined(__AVX512F__)
constexpr int kRowTile = 4;    // x rows per register tile: 16 accumulators of 32 registers
#else
constexpr int kRowTile = 2;    // 16 registers (AVX2): 8 accumulators of 2 registers each
#endif

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
typedef int32_t vi32 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef int8_t vi8 __attribute__((vector_size(16)));
typedef uint8_t vu8 __attribute__((vector_size(16)));

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }

// 16 bytes to 16 floats. GCC 12 widens byte vectors element by element, so by intrinsics.
template <bool kSigned>
inline vf bytes_to_float(const void* p) {
  vf f;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m512i i = kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  const __m512 v = _mm512_cvtepi32_ps(i);
  std::memcpy(&f, &v, sizeof(vf));
#else
  for (int i = 0; i < kLanes; ++i)
    f[i] = kSigned ? static_cast<const int8_t*>(p)[i] : static_cast<const uint8_t*>(p)[i];
#endif
  return f;
}

inline float bits_to_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as XLA's convert
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

inline vf round_to_bf16(vf v) {  // to nearest even, kept in float32
  vu32 bits;
  std::memcpy(&bits, &v, sizeof(vf));
  bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
  std::memcpy(&v, &bits, sizeof(vf));
  return v;
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0x1f) return bits_to_f32(sign | 0x7f800000 | (mantissa << 13));
  if (exponent != 0) return bits_to_f32(sign | ((exponent + 112) << 23) | (mantissa << 13));
  const float value = static_cast<float>(mantissa) * (1.0f / 16777216.0f);  // subnormal
  return sign ? -value : value;
}

enum class Kind { kF32, kBF16, kInt8, kInt4 };

struct Problem {
  const float* x;  // [R, x_stride]: x, or a copy padded with zeros to a multiple of kLanes
  int64_t x_stride;
  const uint16_t* x_bf16;  // [R, x_bf16_stride]: x in bfloat16 (bfloat16 weights, kDotBF16)
  int64_t x_bf16_stride;   // int4: columns [k..k+63] stored as k..k+15, k+32..k+47, k+16..k+31,
                           // k+48..k+63 (the nibbles' order, tile_dot_int4_bf16), 0-padded
  const float* x_sum;      // int4, bfloat16 product: [R, x_sum_stride] x_bf16's sum per group
  int64_t x_sum_stride;
  int64_t rows, in, out;  // R, I, O
  int64_t weight_bytes;    // of W (and its scales)
  Kind kind;
  const char* w;
  const void* scales;  // [O, G] float32 or float16 (int8, int4)
  const void* mins;    // [O, I/32] (int4)
  bool scales_f16, mins_f16;
  bool bf16;  // the product is bfloat16's: x and dequantized weights rounded to bfloat16
  int64_t groups;  // G
  const int32_t* vector_group;  // int8: the group of each 16 columns (one past the end too)
  float* y;        // [R, O]
};

inline float scale_at(const void* p, bool f16, int64_t i) {
  return f16 ? f16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Phase 1: columns [k0, k0 + n) of weight row `o` as float32 into dst, zeros up to n_pad.
void dequantize_row(const Problem& pb, int64_t o, int64_t k0, int64_t n, int64_t n_pad,
                    float* dst) {
  const int64_t vec_end = n - n % kLanes;
  switch (pb.kind) {
    case Kind::kF32: {
      std::memcpy(dst, pb.w + 4 * (o * pb.in + k0), 4 * n);
      break;
    }
    case Kind::kBF16: {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(pb.w) + o * pb.in + k0;
      int64_t k = 0;
      for (; k < vec_end; k += kLanes) {
        const vu32 bits = __builtin_convertvector(load<vu16>(src + k), vu32) << 16;
        vf f;
        std::memcpy(&f, &bits, sizeof(vf));
        store(dst + k, f);
      }
      for (; k < n; ++k) dst[k] = bits_to_f32(static_cast<uint32_t>(src[k]) << 16);
      break;
    }
    case Kind::kInt8: {
      const int8_t* src = reinterpret_cast<const int8_t*>(pb.w) + o * pb.in + k0;
      // Groups are a multiple of kLanes columns (or the whole row), so is k0: a vector never
      // straddles two scales.
      const int64_t group = pb.in / pb.groups;
      int64_t g = k0 / group, next = (g + 1) * group - k0;
      float s = scale_at(pb.scales, pb.scales_f16, o * pb.groups + g);
      for (int64_t k = 0; k < n; k += k < vec_end ? kLanes : 1) {
        if (k == next) {
          s = scale_at(pb.scales, pb.scales_f16, o * pb.groups + ++g);
          next += group;
        }
        if (k < vec_end) store(dst + k, bytes_to_float<true>(src + k) * s);
        else dst[k] = src[k] * s;
        if (pb.bf16 && k < vec_end) store(dst + k, round_to_bf16(load<vf>(dst + k)));
        else if (pb.bf16) dst[k] = bits_to_f32(static_cast<uint32_t>(f32_to_bf16(dst[k])) << 16);
      }
      break;
    }
    case Kind::kInt4: {  // n is a multiple of 32 (I is, and so is kChunk)
      const uint8_t* src = reinterpret_cast<const uint8_t*>(pb.w) + (o * pb.in + k0) / 2;
      for (int64_t k = 0; k < n; k += 32) {
        const int64_t g = o * pb.groups + (k0 + k) / 32;
        const float s = scale_at(pb.scales, pb.scales_f16, g);
        const float m = scale_at(pb.mins, pb.mins_f16, g);
        alignas(16) uint8_t q[32];  // the group's 4-bit values in order (GGUF's nibbles)
        const vu8 bytes = load<vu8>(src + k / 2);
        const vu8 lo = bytes & 0xF, hi = bytes >> 4;
        std::memcpy(q, &lo, 16);
        std::memcpy(q + 16, &hi, 16);
        vf lo_f = bytes_to_float<false>(q) * s + m, hi_f = bytes_to_float<false>(q + 16) * s + m;
        if (pb.bf16) lo_f = round_to_bf16(lo_f), hi_f = round_to_bf16(hi_f);
        store(dst + k, lo_f);
        store(dst + k + 16, hi_f);
      }
      break;
    }
  }
  for (int64_t k = n; k < n_pad; ++k) dst[k] = 0.0f;
}

inline float lane_sum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Phase 2: acc[r][j] += x[r, :n_pad] . w[j, :n_pad] for RT rows of x and kOutBlock rows of w.
template <int RT>
void tile_dot(const float* x, int64_t x_stride, const float* w, int64_t n_pad, float* acc) {
  vf sums[RT][kOutBlock] = {};
  for (int64_t k = 0; k < n_pad; k += kLanes) {
    vf wv[kOutBlock];
    for (int j = 0; j < kOutBlock; ++j) wv[j] = load<vf>(w + j * kChunk + k);
    for (int r = 0; r < RT; ++r) {
      const vf xv = load<vf>(x + r * x_stride + k);
      for (int j = 0; j < kOutBlock; ++j) sums[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) acc[r * kOutBlock + j] += lane_sum(sums[r][j]);
}

template <int RT>
void tile_dots(const Problem& pb, int64_t k0, int64_t n_pad, const float* w, float* acc) {
  for (int64_t r = 0; r + RT <= pb.rows; r += RT)
    tile_dot<RT>(pb.x + r * pb.x_stride + k0, pb.x_stride, w, n_pad, acc + r * kOutBlock);
}


#if defined(__AVX512BF16__)
constexpr bool kDotBF16 = true;

// bfloat16 weights with AVX512-BF16: x in bfloat16 too, and vdpbf16ps multiplies 32 pairs
// of them straight from the weight rows into float32 sums (no dequantization at all).
template <int RT>
void tile_dot_bf16(const Problem& pb, int64_t r0, const uint16_t* const* w, float* acc) {
  __m512 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm512_setzero_ps();
  const int64_t full = pb.in - pb.in % 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (pb.in % 32)) - 1);
  for (int64_t k = 0; k < pb.in; k += 32) {
    __m512i wv[kOutBlock];
    for (int j = 0; j < kOutBlock; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + kPrefetchRows * pb.in + k), _MM_HINT_T0);
      wv[j] = k < full ? _mm512_loadu_si512(w[j] + k) : _mm512_maskz_loadu_epi16(tail, w[j] + k);
    }
    for (int r = 0; r < RT; ++r) {
      const __m512i xv = _mm512_loadu_si512(pb.x_bf16 + (r0 + r) * pb.x_bf16_stride + k);
      for (int j = 0; j < kOutBlock; ++j)
        sums[r][j] = _mm512_dpbf16_ps(sums[r][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) acc[(r0 + r) * kOutBlock + j] = _mm512_reduce_add_ps(sums[r][j]);
}

void block_bf16(const Problem& pb, int64_t o, int64_t block, float* acc) {
  const uint16_t* w[kOutBlock];
  for (int j = 0; j < kOutBlock; ++j)  // rows past the block repeat its first (unused sums)
    w[j] = reinterpret_cast<const uint16_t*>(pb.w) + (o + (j < block ? j : 0)) * pb.in;
  int64_t r = 0;
  for (; r + 4 <= pb.rows; r += 4) tile_dot_bf16<4>(pb, r, w, acc);
  switch (pb.rows - r) {
    case 3: tile_dot_bf16<3>(pb, r, w, acc); break;
    case 2: tile_dot_bf16<2>(pb, r, w, acc); break;
    case 1: tile_dot_bf16<1>(pb, r, w, acc); break;
  }
}
#else
constexpr bool kDotBF16 = false;
void block_bf16(const Problem&, int64_t, int64_t, float*) {}
#endif

#if defined(__AVX512F__)
constexpr bool kDirectF32 = true;

// float32 weights: multiplied straight from the weight rows (a copy to the scratch would
// cost more than the product at a few rows).
template <int RT>
void tile_dot_f32(const Problem& pb, int64_t r0, const float* const* w, float* acc) {
  __m512 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm512_setzero_ps();
  const int64_t full = pb.in - pb.in % kLanes;
  const __mmask16 tail = static_cast<__mmask16>((1u << (pb.in % kLanes)) - 1);
  for (int64_t k = 0; k < pb.in; k += kLanes) {
    __m512 wv[kOutBlock];
    for (int j = 0; j < kOutBlock; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + kPrefetchRows * pb.in + k), _MM_HINT_T0);
      wv[j] = k < full ? _mm512_loadu_ps(w[j] + k) : _mm512_maskz_loadu_ps(tail, w[j] + k);
    }
    for (int r = 0; r < RT; ++r) {
      const __m512 xv = _mm512_loadu_ps(pb.x + (r0 + r) * pb.x_stride + k);
      for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm512_fmadd_ps(xv, wv[j], sums[r][j]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j)
      acc[(r0 + r) * kOutBlock + j] = _mm512_reduce_add_ps(sums[r][j]);
}

void block_f32(const Problem& pb, int64_t o, int64_t block, float* acc) {
  const float* w[kOutBlock];
  for (int j = 0; j < kOutBlock; ++j)  // rows past the block repeat its first (unused sums)
    w[j] = reinterpret_cast<const float*>(pb.w) + (o + (j < block ? j : 0)) * pb.in;
  int64_t r = 0;
  for (; r + 4 <= pb.rows; r += 4) tile_dot_f32<4>(pb, r, w, acc);
  switch (pb.rows - r) {
    case 3: tile_dot_f32<3>(pb, r, w, acc); break;
    case 2: tile_dot_f32<2>(pb, r, w, acc); break;
    case 1: tile_dot_f32<1>(pb, r, w, acc); break;
  }
}
#else
constexpr bool kDirectF32 = false;
void block_f32(const Problem&, int64_t, int64_t, float*) {}
#endif


#if defined(__AVX512BF16__)
constexpr bool kDirectQuant = true;

inline float scale_value(const void* p, bool f16, int64_t i) {
  return f16 ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// int8 weights (and int4 in a float32 product) at up to kRowTile rows of x: each 32 columns
// of the block's weight rows are dequantized in registers (widened to float32, times the
// scale, plus the minimum for int4) and multiplied there -- for a bfloat16 product rounded to bfloat16 (vcvtne2ps2bf16,
// to nearest even as XLA's convert) and multiplied by vdpbf16ps, else by float32 FMAs. No
// scratch: the weight bytes are read once and touch no memory but the registers, so the
// product streams half (int8) or a quarter (int4) of bfloat16's bytes at the same speed.
// Groups of int8 scales are whole vectors of 16 columns, int4's are the 32 of a step.
template <int RT, Kind K, bool kBF16>
void tile_dot_quant(const Problem& pb, int64_t o, int64_t block, float* acc) {
  int64_t rows[kOutBlock];
  for (int j = 0; j < kOutBlock; ++j) rows[j] = o + (j < block ? j : 0);
  __m512 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm512_setzero_ps();
  float s[kOutBlock][2];    // int8: the scales of this step's two vectors of 16 columns
  int32_t g[2] = {-1, -1};  // and their groups
  for (int64_t k = 0; k < pb.in; k += 32) {
    __m512 lo[kOutBlock], hi[kOutBlock];  // columns k..k+15 and k+16..k+31
    if constexpr (K == Kind::kInt8) {
      for (int h = 0; h < 2; ++h) {
        const int32_t group = pb.vector_group[k / 16 + h];
        if (group == g[h]) continue;
        g[h] = group;
        for (int j = 0; j < kOutBlock; ++j)
          s[j][h] = scale_value(pb.scales, pb.scales_f16, rows[j] * pb.groups + group);
      }
      const int64_t left = pb.in - k;
      const __mmask16 m_lo = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m_hi =
          left >= 32 ? 0xffff : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
      for (int j = 0; j < kOutBlock; ++j) {
        const int8_t* w = reinterpret_cast<const int8_t*>(pb.w) + rows[j] * pb.in + k;
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * pb.in), _MM_HINT_T0);
        // Masked loads only at the tail: from memory they were ~10x slower here.
        const __m128i b_lo = left >= 32 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w))
                                        : _mm_maskz_loadu_epi8(m_lo, w);
        const __m128i b_hi = left >= 32
                                 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))
                                 : _mm_maskz_loadu_epi8(m_hi, w + 16);
        lo[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b_lo)),
                              _mm512_set1_ps(s[j][0]));
        hi[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b_hi)),
                              _mm512_set1_ps(s[j][1]));
      }
    } else {  // int4: I % 32 == 0, one group a step (GGUF Q4_1's nibbles, see the top)
      const __m128i low4 = _mm_set1_epi8(0xF);
      for (int j = 0; j < kOutBlock; ++j) {
        const int64_t gi = rows[j] * pb.groups + k / 32;
        const __m512 sc = _mm512_set1_ps(scale_value(pb.scales, pb.scales_f16, gi));
        const __m512 mn = _mm512_set1_ps(scale_value(pb.mins, pb.mins_f16, gi));
        const uint8_t* w = reinterpret_cast<const uint8_t*>(pb.w) + (rows[j] * pb.in + k) / 2;
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * pb.in / 2), _MM_HINT_T0);
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
        const __m128i q_lo = _mm_and_si128(b, low4);
        const __m128i q_hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        lo[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q_lo)), sc, mn);
        hi[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q_hi)), sc, mn);
      }
    }
    if constexpr (kBF16) {
      for (int j = 0; j < kOutBlock; ++j) {
        const __m512bh w = _mm512_cvtne2ps_pbh(hi[j], lo[j]);
        for (int r = 0; r < RT; ++r) {
          const __m512i xv = _mm512_loadu_si512(pb.x_bf16 + r * pb.x_bf16_stride + k);
          sums[r][j] = _mm512_dpbf16_ps(sums[r][j], (__m512bh)xv, w);
        }
      }
    } else {
      for (int r = 0; r < RT; ++r) {
        const __m512 x_lo = _mm512_loadu_ps(pb.x + r * pb.x_stride + k);
        const __m512 x_hi = _mm512_loadu_ps(pb.x + r * pb.x_stride + k + 16);
        for (int j = 0; j < kOutBlock; ++j)
          sums[r][j] = _mm512_fmadd_ps(x_hi, hi[j], _mm512_fmadd_ps(x_lo, lo[j], sums[r][j]));
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) acc[r * kOutBlock + j] = _mm512_reduce_add_ps(sums[r][j]);
}

// int4 weights in a bfloat16 product, at any rows, by Q4_1's algebra: over a group,
//     x . (d q + m) = 16 d (x . (1 + q / 16)) + (m - 16 d) sum(x),
// with sum(x) per group of each row of x computed once per call (Problem::x_sum, of x as
// rounded to bfloat16). 1 + q / 16 is exact in bfloat16: its bits are 0x3F80 | q << 3, so a
// shift and a vpternlogd ((w << 3) & 0x78 | 0x3F80) after vpmovzxbw of a pair of groups' 32
// bytes give their 32 low-nibble weights, (w >> 1) & 0x78 | 0x3F80 the 32 high ones, ready
// for vdpbf16ps -- no float conversion, scaling or rounding of the weights (more exact than
// dequantizing to bfloat16 first). The offset 1 (not 128 + q, bits 0x4300 | q, one op less)
// keeps the cancellation against (m - 16 d) sum(x) small: 6-8x smaller errors, within 2-5x
// a float32 dot's, at the same speed within this machine's noise. x_bf16 is permuted per 64
// columns (Problem) to line up: lanes 0-7 of the dot's sums are the first group's, 8-15 the
// second's, multiplied by [16 d_g x8, 16 d_g+1 x8] (a vpermps of 16 groups' scales) into the
// accumulators. The (m - 16 d) sum(x) terms go into the same accumulators, 16 groups a vector.
inline __m512 load_groups(const void* p, bool f16, int64_t i, __mmask16 mask) {
  if (f16) {
    const uint16_t* h = static_cast<const uint16_t*>(p) + i;
    return _mm512_cvtph_ps(mask == 0xffff ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))
                                          : _mm256_maskz_loadu_epi16(mask, h));
  }
  const float* f = static_cast<const float*>(p) + i;
  return mask == 0xffff ? _mm512_loadu_ps(f) : _mm512_maskz_loadu_ps(mask, f);
}

template <int RT>
void tile_dot_int4_bf16(const Problem& pb, int64_t r0, const int64_t* rows, float* acc) {
  __m512 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm512_setzero_ps();
  const uint8_t* w[kOutBlock];
  for (int j = 0; j < kOutBlock; ++j) w[j] = reinterpret_cast<const uint8_t*>(pb.w) + rows[j] * pb.in / 2;
  const uint16_t* x = pb.x_bf16 + r0 * pb.x_bf16_stride;
  const float* x_sum = pb.x_sum + r0 * pb.x_sum_stride;
  const __m512i nibble = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(0x3F80);
  const int64_t ahead = kPrefetchRows * pb.in / 2;
  for (int64_t c = 0; c < pb.groups; c += 16) {  // 16 groups (512 columns) at a time
    const int64_t left = pb.groups - c;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    __m512 d[kOutBlock];
    for (int j = 0; j < kOutBlock; ++j) {
      const int64_t gi = rows[j] * pb.groups + c;
      d[j] = load_groups(pb.scales, pb.scales_f16, gi, mask);
      const __m512 m = load_groups(pb.mins, pb.mins_f16, gi, mask);
      const __m512 offset = _mm512_fmadd_ps(d[j], _mm512_set1_ps(-16.0f), m);
      d[j] = _mm512_mul_ps(d[j], _mm512_set1_ps(16.0f));
      for (int r = 0; r < RT; ++r)
        sums[r][j] = _mm512_fmadd_ps(offset, _mm512_loadu_ps(x_sum + r * pb.x_sum_stride + c),
                                     sums[r][j]);
    }
    const int64_t pairs = left >= 16 ? 8 : (left + 1) / 2;
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t k = (c + 2 * p) * 32;  // the pair's first column
      const bool both = c + 2 * p + 1 < pb.groups;
      const __m512i idx = _mm512_set_epi32(2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                           2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                           2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p);
      __m512i x_lo[RT], x_hi[RT];
      for (int r = 0; r < RT; ++r) {
        x_lo[r] = _mm512_loadu_si512(x + r * pb.x_bf16_stride + k);
        x_hi[r] = _mm512_loadu_si512(x + r * pb.x_bf16_stride + k + 32);
      }
      for (int j = 0; j < kOutBlock; ++j) {
        const uint8_t* b = w[j] + k / 2;
        _mm_prefetch(reinterpret_cast<const char*>(b + ahead), _MM_HINT_T0);
        const __m256i bytes =
            both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))
                 : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
        const __m512i w16 = _mm512_cvtepu8_epi16(bytes);
        const __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi16(w16, 3), nibble, one, 0xEA);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w16, 1), nibble, one, 0xEA);
        const __m512 scale = _mm512_permutexvar_ps(idx, d[j]);
        for (int r = 0; r < RT; ++r) {
          __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)x_lo[r], (__m512bh)lo);
          dot = _mm512_dpbf16_ps(dot, (__m512bh)x_hi[r], (__m512bh)hi);
          sums[r][j] = _mm512_fmadd_ps(dot, scale, sums[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j)
      acc[(r0 + r) * kOutBlock + j] = _mm512_reduce_add_ps(sums[r][j]);
}

void block_int4_bf16(const Problem& pb, int64_t o, int64_t block, float* acc) {
  int64_t rows[kOutBlock];  // rows past the block repeat its first (unused sums)
  for (int j = 0; j < kOutBlock; ++j) rows[j] = o + (j < block ? j : 0);
  int64_t r = 0;
  for (; r + 4 <= pb.rows; r += 4) tile_dot_int4_bf16<4>(pb, r, rows, acc);
  switch (pb.rows - r) {
    case 3: tile_dot_int4_bf16<3>(pb, r, rows, acc); break;
    case 2: tile_dot_int4_bf16<2>(pb, r, rows, acc); break;
    case 1: tile_dot_int4_bf16<1>(pb, r, rows, acc); break;
  }
}

template <Kind K, bool kBF16>
void block_quant_rows(const Problem& pb, int64_t o, int64_t block, float* acc) {
  switch (pb.rows) {
    case 4: tile_dot_quant<4, K, kBF16>(pb, o, block, acc); break;
    case 3: tile_dot_quant<3, K, kBF16>(pb, o, block, acc); break;
    case 2: tile_dot_quant<2, K, kBF16>(pb, o, block, acc); break;
    default: tile_dot_quant<1, K, kBF16>(pb, o, block, acc); break;
  }
}

void block_quant(const Problem& pb, int64_t o, int64_t block, float* acc) {
  if (pb.kind == Kind::kInt8) {
    if (pb.bf16) block_quant_rows<Kind::kInt8, true>(pb, o, block, acc);
    else block_quant_rows<Kind::kInt8, false>(pb, o, block, acc);
  } else if (pb.bf16) {
    block_int4_bf16(pb, o, block, acc);
  } else {
    block_quant_rows<Kind::kInt4, false>(pb, o, block, acc);
  }
}
#else
constexpr bool kDirectQuant = false;
void block_quant(const Problem&, int64_t, int64_t, float*) {}
#endif

// Whether the block takes the direct path of its kind (no dequantized scratch).
inline bool direct(const Problem& pb) {
  switch (pb.kind) {
    case Kind::kBF16: return kDotBF16;
    case Kind::kF32: return kDirectF32;
    case Kind::kInt4: return kDirectQuant && (pb.bf16 || pb.rows <= kRowTile);
    default: return kDirectQuant && pb.rows <= kRowTile;
  }
}

// One work item: weight rows [o_begin, o_end).
void run_rows(const Problem& pb, int64_t o_begin, int64_t o_end) {
  alignas(64) static thread_local float w[kOutBlock * kChunk];
  static thread_local std::vector<float> acc;
  acc.resize(pb.rows * kOutBlock);
  const int64_t full = pb.rows - pb.rows % kRowTile;
  for (int64_t o = o_begin; o < o_end; o += kOutBlock) {
    const int64_t block = std::min<int64_t>(kOutBlock, o_end - o);
    std::fill(acc.begin(), acc.end(), 0.0f);
    if (direct(pb)) {
      if (pb.kind == Kind::kBF16) block_bf16(pb, o, block, acc.data());
      else if (pb.kind == Kind::kF32) block_f32(pb, o, block, acc.data());
      else block_quant(pb, o, block, acc.data());
      for (int64_t r = 0; r < pb.rows; ++r)
        for (int64_t j = 0; j < block; ++j) pb.y[r * pb.out + o + j] = acc[r * kOutBlock + j];
      continue;
    }
    for (int64_t k0 = 0; k0 < pb.in; k0 += kChunk) {
      const int64_t n = std::min<int64_t>(kChunk, pb.in - k0);
      const int64_t n_pad = (n + kLanes - 1) / kLanes * kLanes;
      for (int64_t j = 0; j < kOutBlock; ++j) {
        if (j < block) dequantize_row(pb, o + j, k0, n, n_pad, w + j * kChunk);
        else std::fill(w + j * kChunk, w + j * kChunk + n_pad, 0.0f);
      }
      tile_dots<kRowTile>(pb, k0, n_pad, w, acc.data());
      for (int64_t r = full; r < pb.rows; ++r)  // the rows past the last full tile
        tile_dot<1>(pb.x + r * pb.x_stride + k0, pb.x_stride, w, n_pad,
                    acc.data() + r * kOutBlock);
    }
    for (int64_t r = 0; r < pb.rows; ++r)
      for (int64_t j = 0; j < block; ++j) pb.y[r * pb.out + o + j] = acc[r * kOutBlock + j];
  }
}

// A work item: weight rows [begin, end) of problem p (one weight of the call).
struct Item {
  int64_t p, begin, end;
};

// Runs every item on the caller and the pool's threads (as ragged_paged_attention_cpu.cc).
// A pool task may start only after the caller has returned: it then finds no item left (the
// items live in `state`, which it co-owns) and touches nothing else.
struct SharedState {
  explicit SharedState(std::vector<Item> all) : items(std::move(all)) {}
  const std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

// The problems of one call (weights sharing x) stream as one: items over their concatenated
// output rows, parallel when all their weight bytes together reach `parallel_bytes`.
void run_items(ffi::ThreadPool& pool, const std::vector<Problem>& problems,
               int64_t parallel_bytes) {
  int64_t bytes = 0, out = 0;
  for (const Problem& pb : problems) bytes += pb.weight_bytes, out += pb.out;
  if (bytes < parallel_bytes) {  // the caller alone: no shared state to set up
    for (const Problem& pb : problems) run_rows(pb, 0, pb.out);
    return;
  }
  const int64_t workers = pool.num_threads() + 1;
  // About 4 items a worker, for balance when a core is busy elsewhere; whole register tiles.
  int64_t rows = (out + 4 * workers - 1) / (4 * workers);
  rows = std::max<int64_t>(kOutBlock, (rows + kOutBlock - 1) / kOutBlock * kOutBlock);
  std::vector<Item> items;
  for (size_t p = 0; p < problems.size(); ++p)
    for (int64_t o = 0; o < problems[p].out; o += rows)
      items.push_back({static_cast<int64_t>(p), o, std::min(problems[p].out, o + rows)});
  auto state = std::make_shared<SharedState>(std::move(items));
  const Problem* base = problems.data();
  auto worker = [state, base]() {
    state->active.fetch_add(1);
    for (;;) {
      const int64_t i = state->next.fetch_add(1);
      if (i >= static_cast<int64_t>(state->items.size())) break;
      const Item& item = state->items[i];
      run_rows(base[item.p], item.begin, item.end);
    }
    state->active.fetch_sub(1);
  };
  const int64_t helpers =
      std::min<int64_t>(pool.num_threads(), static_cast<int64_t>(state->items.size()) - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = worker;  // Schedule takes its task by value (an rvalue)
    pool.Schedule(std::move(task));
  }
  worker();
  // Every item is claimed; wait for the ones still running.
  while (state->active.load() != 0) std::this_thread::yield();
}

// x for tile_dot_int4_bf16: rounded to bfloat16 (vcvtne2ps2bf16: to nearest even, as XLA's
// convert), permuted and padded with zeros to whole 16 groups (Problem::x_bf16), and its sums
// per group of 32 columns (Problem::x_sum). I % 32 == 0: a step of 64 has one or two groups.
void prepare_int4_x(const float* x, Problem& pb, std::vector<uint16_t>& x_bf16,
                    std::vector<float>& x_sum) {
#if defined(__AVX512BF16__)
  pb.x_sum_stride = (pb.groups + 15) / 16 * 16;
  pb.x_bf16_stride = pb.x_sum_stride * 32;
  x_bf16.assign(pb.rows * pb.x_bf16_stride, 0);
  x_sum.assign(pb.rows * pb.x_sum_stride, 0.0f);
  auto widen = [](__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); };
  for (int64_t r = 0; r < pb.rows; ++r) {
    const float* src = x + r * pb.in;
    uint16_t* dst = x_bf16.data() + r * pb.x_bf16_stride;
    float* sums = x_sum.data() + r * pb.x_sum_stride;
    for (int64_t k = 0; k < pb.in; k += 64) {
      const bool both = k + 32 < pb.in;
      const __m512 zero = _mm512_setzero_ps();
      const __m512 a = _mm512_loadu_ps(src + k), b = _mm512_loadu_ps(src + k + 16);
      const __m512 c = both ? _mm512_loadu_ps(src + k + 32) : zero;
      const __m512 d = both ? _mm512_loadu_ps(src + k + 48) : zero;
      const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(c, a);  // [a, c]
      const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(d, b);  // [b, d]
      _mm512_storeu_si512(dst + k, lo);
      _mm512_storeu_si512(dst + k + 32, hi);
      sums[k / 32] = _mm512_reduce_add_ps(_mm512_add_ps(widen(_mm512_castsi512_si256(lo)),
                                                        widen(_mm512_castsi512_si256(hi))));
      if (both)
        sums[k / 32 + 1] = _mm512_reduce_add_ps(_mm512_add_ps(
            widen(_mm512_extracti64x4_epi64(lo, 1)), widen(_mm512_extracti64x4_epi64(hi, 1))));
    }
  }
  pb.x_bf16 = x_bf16.data();
  pb.x_sum = x_sum.data();
#endif
}

bool is_scale_type(ffi::DataType t) { return t == ffi::F32 || t == ffi::F16; }

// One weight of the call as a Problem (x's fields are set by the caller): checks its shapes.
ffi::Error weight_problem(const ffi::AnyBuffer& w, const ffi::AnyBuffer& scales,
                          const ffi::AnyBuffer& mins, int64_t rows, int64_t in, bool bf16,
                          Problem& pb) {
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 2) return ffi::Error::InvalidArgument("w must be a matrix");
  pb.rows = rows;
  pb.in = in;
  pb.out = w_dims[0];
  pb.w = static_cast<const char*>(w.untyped_data());
  pb.scales = scales.untyped_data();
  pb.mins = mins.untyped_data();
  pb.scales_f16 = scales.element_type() == ffi::F16;
  pb.mins_f16 = mins.element_type() == ffi::F16;
  pb.groups = scales.dimensions().size() == 2 ? scales.dimensions()[1] : 0;
  const bool scaled = scales.dimensions().size() == 2 && scales.dimensions()[0] == pb.out &&
                      is_scale_type(scales.element_type());
  switch (w.element_type()) {
    case ffi::F32: pb.kind = Kind::kF32; break;
    case ffi::BF16: pb.kind = Kind::kBF16; break;
    case ffi::S8: pb.kind = Kind::kInt8; break;
    case ffi::U8: pb.kind = Kind::kInt4; break;
    default: return ffi::Error::InvalidArgument("w must be float32, bfloat16, int8 or uint8");
  }
  if (pb.kind == Kind::kInt4) {
    if (w_dims[1] * 2 != pb.in || pb.in % 32 || !scaled || pb.groups != pb.in / 32 ||
        mins.dimensions().size() != 2 || mins.dimensions()[0] != pb.out ||
        mins.dimensions()[1] != pb.groups || !is_scale_type(mins.element_type()))
      return ffi::Error::InvalidArgument(
          "int4: w u8[O, I/2], scales and mins [O, I/32] float32/16, I % 32 == 0");
  } else if (w_dims[1] != pb.in) {
    return ffi::Error::InvalidArgument("w's input dim must be x's");
  }
  if (pb.kind == Kind::kInt8 &&
      (!scaled || pb.groups < 1 || pb.in % pb.groups ||
       (pb.groups > 1 && (pb.in / pb.groups) % kLanes)))
    return ffi::Error::InvalidArgument(
        "int8: scales [O, G] float32/16, G = 1 or I / G a multiple of 16");
  pb.bf16 = bf16 || pb.kind == Kind::kBF16;
  pb.weight_bytes = w.size_bytes() + scales.size_bytes() + mins.size_bytes();
  if (pb.bf16 && pb.kind == Kind::kF32)
    return ffi::Error::InvalidArgument("bf16 is for bfloat16 or quantized weights");
  return ffi::Error::Success();
}

// The prepared problem `x_ready` (x as the tiles read it, whatever fields that takes) with
// the weight and result of `weight`: the fields weight_problem and Linears set per weight.
Problem with_weight(const Problem& x_ready, const Problem& weight) {
  Problem pb = x_ready;
  pb.out = weight.out;
  pb.weight_bytes = weight.weight_bytes;
  pb.w = weight.w;
  pb.scales = weight.scales, pb.mins = weight.mins;
  pb.scales_f16 = weight.scales_f16, pb.mins_f16 = weight.mins_f16;
  pb.groups = weight.groups;
  pb.vector_group = weight.vector_group;
  pb.y = weight.y;
  return pb;
}

// y_i f32[R, O_i] = x . W_i^T for every weight W_i of the call, streamed as one product.
ffi::Error Linears(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                   ffi::RemainingRets ys, bool bf16, int64_t parallel_bytes) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("x must be a matrix");
  if (ys.size() == 0 || weights.size() != 3 * ys.size())
    return ffi::Error::InvalidArgument("each weight comes as (w, scales, mins), one result each");
  std::vector<Problem> problems(ys.size());
  std::vector<std::vector<int32_t>> vector_groups(ys.size());
  for (size_t i = 0; i < ys.size(); ++i) {
    auto w = weights.get<ffi::AnyBuffer>(3 * i);
    auto scales = weights.get<ffi::AnyBuffer>(3 * i + 1);
    auto mins = weights.get<ffi::AnyBuffer>(3 * i + 2);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (scales.has_error()) return scales.error();
    if (mins.has_error()) return mins.error();
    if (y.has_error()) return y.error();
    Problem& pb = problems[i];
    ffi::Error error = weight_problem(*w, *scales, *mins, x_dims[0], x_dims[1], bf16, pb);
    if (error.failure()) return error;
    if (pb.kind != problems[0].kind)  // x is prepared once, as the kind's tiles read it
      return ffi::Error::InvalidArgument("the weights of one call must be of one kind");
    const auto y_dims = (*y)->dimensions();
    if (y_dims.size() != 2 || y_dims[0] != pb.rows || y_dims[1] != pb.out)
      return ffi::Error::InvalidArgument("each result must be [R, O] of its weight");
    pb.y = (*y)->typed_data();
    if (pb.kind == Kind::kInt8) {
      std::vector<int32_t>& vector_group = vector_groups[i];
      vector_group.resize((pb.in + kLanes - 1) / kLanes + 1);
      const int64_t group = pb.in / pb.groups;
      for (size_t v = 0; v < vector_group.size(); ++v)
        vector_group[v] =
            static_cast<int32_t>(std::min<int64_t>(v * kLanes / group, pb.groups - 1));
      pb.vector_group = vector_group.data();
    }
  }
  if (x_dims[0] == 0) return ffi::Error::Success();
  Problem& pb = problems[0];
  // x as the tiles read it: a bfloat16 product multiplies x rounded to bfloat16 (XLA's dot
  // rounds it the same way), in bfloat16 for vdpbf16ps; float x is padded with zeros to
  // whole vectors when I is not a multiple of kLanes.
  const bool round_x = pb.bf16;
  std::vector<float> padded, x_sum;
  std::vector<uint16_t> x_bf16;
  if (pb.kind == Kind::kInt4 && pb.bf16 && direct(pb)) {
    prepare_int4_x(x.typed_data(), pb, x_bf16, x_sum);
  } else if ((pb.kind == Kind::kBF16 || pb.bf16) && direct(pb)) {
    pb.x_bf16_stride = (pb.in + 31) / 32 * 32;
    x_bf16.assign(pb.rows * pb.x_bf16_stride, 0);
    for (int64_t r = 0; r < pb.rows; ++r)
      for (int64_t k = 0; k < pb.in; ++k)
        x_bf16[r * pb.x_bf16_stride + k] = f32_to_bf16(x.typed_data()[r * pb.in + k]);
    pb.x_bf16 = x_bf16.data();
  } else if (pb.in % (2 * kLanes) == 0 && !round_x) {
    pb.x = x.typed_data();
    pb.x_stride = pb.in;
  } else {  // whole steps of 32 columns (the direct int8 path reads x 32 at a time)
    pb.x_stride = (pb.in + 2 * kLanes - 1) / (2 * kLanes) * (2 * kLanes);
    padded.assign(pb.rows * pb.x_stride, 0.0f);
    for (int64_t r = 0; r < pb.rows; ++r)
      for (int64_t k = 0; k < pb.in; ++k) {
        const float v = x.typed_data()[r * pb.in + k];
        padded[r * pb.x_stride + k] =
            round_x ? bits_to_f32(static_cast<uint32_t>(f32_to_bf16(v)) << 16) : v;
      }
    pb.x = padded.data();
  }
  for (size_t i = 1; i < problems.size(); ++i) problems[i] = with_weight(pb, problems[i]);
  run_items(pool, problems, parallel_bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KsanaLinearCpu, Linears,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [R, I]
                                  // per weight: w [O, I] (int4: [O, I/2]), scales [O, G] or
                                  // [0, 0], mins [O, I/32] or [0, 0]
                                  .RemainingArgs()
                                  .RemainingRets()  // per weight: y f32[R, O]
                                  .Attr<bool>("bf16")  // bfloat16 products (see Problem)
                                  // weight bytes from which the pool's threads join
                                  .Attr<int64_t>("parallel_bytes"));
