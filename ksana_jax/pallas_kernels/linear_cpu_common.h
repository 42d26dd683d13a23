// Shared by linear_cpu.cc and linear_cpu_quant.h (one translation unit: linear_cpu.cc
// includes both): constants, vector types and conversions, and the Problem one weight of a
// call is. cpu_build.py's cache key covers the headers a kernel source includes.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// The direct paths (no dequantized scratch) are written for AVX-512 with BF16 (vdpbf16ps, and
// VNNI's vpdpbusd: Zen 4 and 5, Cooper Lake, Sapphire Rapids) and, where those are missing,
// for AVX2 with FMA and F16C (linear_cpu_avx2.h).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512BF16__)
#define KSANA_LINEAR_AVX2 1
#endif
#if defined(__AVX512F__) || defined(KSANA_LINEAR_AVX2) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_simd.h"

namespace ksana_linear_cpu {


constexpr int kLanes = 16;     // floats per vector (one AVX-512 register, two AVX2 ones)
constexpr int kOutBlock = 4;   // weight rows per register tile
// The direct paths prefetch the weights this many bytes past the next block's start (a
// prefetch past W's end is dropped: it does not fault). See Ahead.
constexpr int64_t kAheadBytes = 2048;
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
#elif defined(KSANA_LINEAR_AVX2)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m128i b_hi = _mm_srli_si128(b, 8);
  const __m256 lo = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  const __m256 hi =
      _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b_hi) : _mm256_cvtepu8_epi32(b_hi));
  std::memcpy(&f, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&f) + sizeof(lo), &hi, sizeof(hi));
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

// n floats to bfloat16, to nearest even (vcvtne2ps2bf16 where the CPU has it: 32 a step,
// where one call's x of 16 rows converted element by element took ~10% of the product).
inline void to_bf16(const float* src, int64_t n, uint16_t* dst) {
  int64_t k = 0;
#if defined(__AVX512BF16__)
  for (; k < n; k += 32) {
    const int64_t left = n - k;
    const __mmask16 lo = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 hi =
        left >= 32 ? 0xffff : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
    const __mmask32 both =
        left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << left) - 1);
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + k + 16),
                                              _mm512_maskz_loadu_ps(lo, src + k));
    _mm512_mask_storeu_epi16(dst + k, both, (__m512i)pair);
  }
#endif
  for (; k < n; ++k) dst[k] = f32_to_bf16(src[k]);
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

#if defined(__AVX512F__)
// out[r * C + c] = the sum of v[r][c]'s lanes (a register tile's accumulators), by
// lane_sums16 for any tile of up to 16 (zeros for the rest): reducing each accumulator on
// its own took the array's address, and GCC 12 then stored every accumulator to the stack at
// every step of the loop summing into it (a 64-byte store per multiply-add: 1-3-row tiles
// ran ~1.5x slower).
template <int R, int C>
__attribute__((always_inline)) inline void store_lane_sums(const __m512 (&v)[R][C],
                                                           float* out) {
  static_assert(R * C <= 16, "one vector of sums");
  const __m512 zero = _mm512_setzero_ps();
  auto at = [&](int i) { return i < R * C ? v[i / C][i % C] : zero; };
  const __m512 sums =
      ksana_cpu_simd::lane_sums16(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8),
                                  at(9), at(10), at(11), at(12), at(13), at(14), at(15));
  if constexpr (R * C == 16) _mm512_storeu_ps(out, sums);
  else _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << (R * C)) - 1), sums);
}
#endif

// Calls tile(std::integral_constant<int, RT>{}, r0) over x's rows in register tiles: RT = 4
// while 4 rows are left, then one tile of the 1-3 rows past them (RT a compile-time constant,
// as the tiles' accumulator arrays need).
template <typename Tile>
inline void for_row_tiles(int64_t rows, Tile tile) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile(std::integral_constant<int, 4>{}, r);
  switch (rows - r) {
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
  }
}

#if defined(__AVX512F__) || defined(KSANA_LINEAR_AVX2)
// The direct paths' prefetching. A tile reads its block's kOutBlock weight rows side by side,
// a vector of each in turn: kOutBlock streams a row apart, which the hardware's prefetchers
// follow poorly (Zen 4, rows of 0.75-1.2 KB: ~10 GB/s a core, against ~24 for one sequential
// stream). A block's rows are adjacent in memory, so a tile prefetches the bytes after its
// block in address order instead, one 64-byte line for each line it reads. Only a block's
// first tile of x's rows does (`first`): the others read what it has read.
struct Ahead {
  // For the block whose first row starts at `block` (rows of `row_bytes`).
  Ahead(const void* block, int64_t row_bytes, bool first)
      : at(first ? static_cast<const char*>(block) + kOutBlock * row_bytes + kAheadBytes
                 : nullptr) {}
  void step() {
    if (at == nullptr) return;
    _mm_prefetch(at, _MM_HINT_T0);
    at += 64;
  }
  const char* at;
};
#endif

enum class Kind { kF32, kBF16, kInt8, kInt4 };

// A work item's running argmax (LinearArgmax): for each x row r, the largest sum so far
// (value[r]) and the first weight row giving it (index[r], -1 for none yet).
struct Argmax {
  float* value = nullptr;  // null: the item's sums go to y
  int32_t* index = nullptr;

  // Sum v of x row r and weight row o; an item meets its weight rows in order, so a tie
  // keeps the first.
  void fold(int64_t r, int64_t o, float v) const {
    if (v > value[r]) value[r] = v, index[r] = static_cast<int32_t>(o);
  }
};

// Every work item's Argmax, [items][stride] (stride: R rounded up to 16, so an item's part
// starts a cache line after the one before it and a vector of 16 rows never leaves it).
struct ArgmaxItems {
  int64_t items = 0, stride = 0;
  std::vector<float> value;
  std::vector<int32_t> index;

  void reset(int64_t n, int64_t rows) {
    items = n, stride = (rows + 15) / 16 * 16;
    value.assign(items * stride, -std::numeric_limits<float>::infinity());
    index.assign(items * stride, -1);
  }
  Argmax item(int64_t i) { return {value.data() + i * stride, index.data() + i * stride}; }
  // Each row's first largest sum over the items in order (weight row 0 where no sum is
  // larger than -inf: a row of NaN or -inf), to ids[r].
  void first_max(int64_t rows, int32_t* ids) const {
    for (int64_t r = 0; r < rows; ++r) {
      float best = -std::numeric_limits<float>::infinity();
      int32_t at = 0;
      for (int64_t i = 0; i < items; ++i)
        if (index[i * stride + r] >= 0 && value[i * stride + r] > best)
          best = value[i * stride + r], at = index[i * stride + r];
      ids[r] = at;
    }
  }
};

struct Problem {
  const float* x;  // [R, x_stride]: x, or a copy padded with zeros to a multiple of kLanes
  int64_t x_stride;
  const uint16_t* x_bf16;  // [R, x_bf16_stride]: x in bfloat16 (bfloat16 weights, kDotBF16)
  int64_t x_bf16_stride;
  int64_t rows, in, out;  // R, I, O
  int64_t weight_bytes;    // of W (and its scales)
  int64_t row_bytes;       // of a row of W
  Kind kind;
  const char* w;
  const void* scales;  // [O, G] float32 or float16 (int8, int4)
  const void* mins;    // [O, I/32] (int4)
  bool scales_f16, mins_f16;
  bool bf16;  // the product is bfloat16's: x and dequantized weights rounded to bfloat16
  int64_t groups;  // G
  const int32_t* vector_group;  // int8: the group of each 16 columns (one past the end too)
  // Whether the call's int8 / int4 weights (its kind) take integer dots (integer_dots_fit)
  bool integer_dots;
  // int8 / int4 in a bfloat16 product by integer dots (tile_dot_int8_vnni, tile_dot_int4_vnni):
  // x rounded to bfloat16, then per group of 32 columns signed bytes times a step, the
  // group's largest magnitude / 127 (prepare_x8): [R, x8_stride] bytes (int8: in column
  // order; int4: per 4 groups as the nibbles are), the steps and a sum per group
  // [R, x_sum_stride] (int4: x's sums, for the minimums; int8: -128 step sum(q), for the
  // weights' offset bytes), zeros past the last group up to a whole 16 groups
  const int8_t* x8;
  int64_t x8_stride;
  const float* x8_scale;
  const float* x_sum;
  int64_t x_sum_stride;
  // int8 with one scale a row: x's steps per 64 columns as the dot's lanes take them (8 a
  // group) [R, 8 x_sum_stride], and per row the sum of x_sum (-128 sum(step q))
  const float* x8_lanes;
  const float* x_offset;
  // bfloat16 weights on AMX (linear_cpu.cc, amx_rows): x in the tiles' pair layout, per 32
  // columns per 16 rows of x a 16 x 32 tile [column pair][x row][2]; x_amx_groups = R / 16
  // rounded up; null where the call does not take AMX tiles
  const uint16_t* x_amx;
  int64_t x_amx_groups;
  // float32 weights with AVX-512 (linear_cpu.cc, run_rows_f32): x transposed, per 32 rows
  // [I][32] (zeros past R); null otherwise
  const float* x_t;
  float* y;        // [R, O]
  const float* residual;  // [R, O], added to y, or null
  ArgmaxItems* argmax;  // LinearArgmax: the items' maxima instead of y (run_items); or null
};

// Element i of a float32 or float16 (`f16`) array of scales or minimums.
inline float scale_at(const void* p, bool f16, int64_t i) {
  if (!f16) return static_cast<const float*>(p)[i];
#if defined(__F16C__)
  return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
#else
  return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
#endif
}

// An int8 block's scales for a step of 32 columns (its two vectors of 16), for the direct
// paths' in-register dequantization (tile_dot_quant): looked up again only when a vector's
// group changes (groups are whole vectors of 16 columns).
struct Int8StepScales {
  float s[kOutBlock][2];  // [weight row of the block][vector]
  int32_t g[2] = {-1, -1};

  void at(const Problem& pb, const int64_t* rows, int64_t k) {
    for (int h = 0; h < 2; ++h) {
      const int32_t group = pb.vector_group[k / 16 + h];
      if (group == g[h]) continue;
      g[h] = group;
      for (int j = 0; j < kOutBlock; ++j)
        s[j][h] = scale_at(pb.scales, pb.scales_f16, rows[j] * pb.groups + group);
    }
  }
};

}  // namespace ksana_linear_cpu
