// linear_cpu.cc's direct paths for CPUs with AVX2, FMA and F16C but no AVX512-BF16 (Zen 2
// and 3, Intel's client cores, Skylake-X and Ice Lake servers), where the AVX-512 ones do not
// build: bfloat16 weights widened in registers, and int8 / int4 in a bfloat16 product by
// integer dots of bytes (vpmaddubsw, llama.cpp's AVX2 way). Without them such a CPU took the
// generic chunked path, element by element: SmolLM2's int4 decode step ran 138 ms, 34x its
// floor (Zen 3, 2026-12-03). Included by linear_cpu_quant.h; see linear_cpu.cc's header.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "linear_cpu_common.h"

namespace ksana_linear_cpu {


// out[r * kOutBlock + j] = the sum of v[r][j]'s lanes: two horizontal adds a row give the
// four sums of each 128-bit half, the halves added. By reference into an inlined function:
// the accumulators stay in registers (see store_lane_sums).
template <int RT>
__attribute__((always_inline)) inline void store_sums8(const __m256 (&v)[RT][kOutBlock],
                                                       float* out) {
  static_assert(kOutBlock == 4, "four sums a row of x");
  for (int r = 0; r < RT; ++r) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v[r][0], v[r][1]),
                                    _mm256_hadd_ps(v[r][2], v[r][3]));
    _mm_storeu_ps(out + r * kOutBlock,
                  _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
  }
}

// Calls tile(std::integral_constant<int, RT>{}, r0) over x's rows in tiles of up to 2 rows:
// 8 accumulators of AVX2's 16 registers.
template <typename Tile>
inline void for_avx2_row_tiles(int64_t rows, Tile tile) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) tile(std::integral_constant<int, 2>{}, r);
  if (r < rows) tile(std::integral_constant<int, 1>{}, r);
}

// bfloat16 weights: 16 of a row a step, as the float32 values of its even columns (each
// 32-bit pair shifted left by 16) and of its odd ones (the pair's high half, masked), each
// multiplied by x's same columns, widened alike from x's bfloat16 (x_bf16).
template <int RT>
void tile_dot_bf16(const Problem& pb, int64_t r0, const uint16_t* const* w, float* acc) {
  __m256 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  Ahead ahead(w[0], pb.row_bytes, r0 == 0);
  const int64_t full = pb.in - pb.in % 16;
  for (int64_t k = 0; k < pb.in; k += 16) {
    __m256 x_even[RT], x_odd[RT];  // x_bf16 is zero past I, to a whole 32 columns
    for (int r = 0; r < RT; ++r) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(pb.x_bf16 + (r0 + r) * pb.x_bf16_stride + k));
      x_even[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));
      x_odd[r] = _mm256_castsi256_ps(_mm256_and_si256(xv, high));
    }
    for (int j = 0; j < kOutBlock; ++j) {
      if (k % 32 == 0) ahead.step();  // a 64-byte line every 32 columns
      __m256i wv;
      if (k < full) {
        wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + k));
      } else {  // the row's last I % 16 columns, zeros after them (not the next row's)
        alignas(32) uint16_t tail[16] = {};
        std::memcpy(tail, w[j] + k, 2 * (pb.in - k));
        wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
      }
      const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
      for (int r = 0; r < RT; ++r)
        sums[r][j] = _mm256_fmadd_ps(x_odd[r], w_odd, _mm256_fmadd_ps(x_even[r], w_even, sums[r][j]));
    }
  }
  store_sums8(sums, acc + r0 * kOutBlock);
}

inline void block_bf16(const Problem& pb, int64_t o, int64_t block, float* acc) {
  const uint16_t* w[kOutBlock];
  for (int j = 0; j < kOutBlock; ++j)  // rows past the block repeat its first (unused sums)
    w[j] = reinterpret_cast<const uint16_t*>(pb.w) + (o + (j < block ? j : 0)) * pb.in;
  for_avx2_row_tiles(pb.rows, [&](auto rt, int64_t r) { tile_dot_bf16<rt>(pb, r, w, acc); });
}

// 8 floats rounded to bfloat16 (to nearest even, as XLA's convert; NaN stays NaN), kept in
// float32.
inline __m256 bf16_rounded(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)),
      _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// 8 bytes to 8 floats.
template <bool kSigned>
inline __m256 bytes8_to_float(__m128i b) {
  return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// int8 and int4 weights where integer dots do not apply (a float32 product, or int8 groups
// of 16 columns), at up to kRowTile rows of x: each 32 columns of the block's weight rows
// dequantized in registers (widened to float32, times the scale, plus the minimum for int4;
// for a bfloat16 product rounded to bfloat16, x widened from x_bf16) and multiplied there by
// FMAs, as linear_cpu_quant.h's AVX-512 tile_dot_quant. An int8 row's last I % 32 columns
// come through a zeroed copy (AVX2 has no masked byte loads).
template <int RT, Kind K, bool kBF16>
void tile_dot_quant(const Problem& pb, int64_t o, int64_t block, float* acc) {
  int64_t rows[kOutBlock];
  for (int j = 0; j < kOutBlock; ++j) rows[j] = o + (j < block ? j : 0);
  __m256 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm256_setzero_ps();
  Int8StepScales scales;  // int8's
  Ahead ahead(pb.w + o * pb.row_bytes, pb.row_bytes, true);  // one tile of all rows
  constexpr int64_t kLineColumns = K == Kind::kInt8 ? 64 : 128;
  const __m128i low4 = _mm_set1_epi8(0xF);
  for (int64_t k = 0; k < pb.in; k += 32) {
    __m256 w[kOutBlock][4];  // columns k..k+31, 8 a vector
    if constexpr (K == Kind::kInt8) {
      scales.at(pb, rows, k);
    }
    for (int j = 0; j < kOutBlock; ++j) {
      if (k % kLineColumns == 0) ahead.step();
      __m128i b_lo, b_hi;  // int8: columns k..k+15 and k+16..k+31; int4: the packed group
      if constexpr (K == Kind::kInt8) {
        const int8_t* at = reinterpret_cast<const int8_t*>(pb.w) + rows[j] * pb.in + k;
        alignas(16) int8_t tail[32] = {};
        if (pb.in - k < 32) at = static_cast<const int8_t*>(std::memcpy(tail, at, pb.in - k));
        b_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
        b_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16));
        const __m256 s_lo = _mm256_set1_ps(scales.s[j][0]), s_hi = _mm256_set1_ps(scales.s[j][1]);
        w[j][0] = _mm256_mul_ps(bytes8_to_float<true>(b_lo), s_lo);
        w[j][1] = _mm256_mul_ps(bytes8_to_float<true>(_mm_srli_si128(b_lo, 8)), s_lo);
        w[j][2] = _mm256_mul_ps(bytes8_to_float<true>(b_hi), s_hi);
        w[j][3] = _mm256_mul_ps(bytes8_to_float<true>(_mm_srli_si128(b_hi, 8)), s_hi);
      } else {  // int4: I % 32 == 0, one group a step (GGUF Q4_1's nibbles)
        const int64_t gi = rows[j] * pb.groups + k / 32;
        const __m256 sc = _mm256_set1_ps(scale_at(pb.scales, pb.scales_f16, gi));
        const __m256 mn = _mm256_set1_ps(scale_at(pb.mins, pb.mins_f16, gi));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
            reinterpret_cast<const uint8_t*>(pb.w) + (rows[j] * pb.in + k) / 2));
        b_lo = _mm_and_si128(b, low4);
        b_hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        w[j][0] = _mm256_fmadd_ps(bytes8_to_float<false>(b_lo), sc, mn);
        w[j][1] = _mm256_fmadd_ps(bytes8_to_float<false>(_mm_srli_si128(b_lo, 8)), sc, mn);
        w[j][2] = _mm256_fmadd_ps(bytes8_to_float<false>(b_hi), sc, mn);
        w[j][3] = _mm256_fmadd_ps(bytes8_to_float<false>(_mm_srli_si128(b_hi, 8)), sc, mn);
      }
      if constexpr (kBF16)
        for (int v = 0; v < 4; ++v) w[j][v] = bf16_rounded(w[j][v]);
    }
    for (int r = 0; r < RT; ++r) {
      __m256 xv[4];  // zeros past I (padded x, x_bf16)
      for (int v = 0; v < 4; ++v) {
        if constexpr (kBF16)
          xv[v] = _mm256_castsi256_ps(_mm256_slli_epi32(
              _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                  pb.x_bf16 + r * pb.x_bf16_stride + k + 8 * v))),
              16));
        else
          xv[v] = _mm256_loadu_ps(pb.x + r * pb.x_stride + k + 8 * v);
      }
      for (int j = 0; j < kOutBlock; ++j)
        for (int v = 0; v < 4; ++v) sums[r][j] = _mm256_fmadd_ps(xv[v], w[j][v], sums[r][j]);
    }
  }
  store_sums8(sums, acc);
}

// n (<= 8) groups' scales or minimums from index i on of an array of `total`, as float32
// lanes, zeros after them: a whole vector where the array has one, the lanes past n masked
// (elementwise stores read back as a vector stall on store forwarding: at I = 576 a row's
// last two groups took a quarter of the product's time).
inline __m256 load_groups8(const void* p, bool f16, int64_t i, int64_t n, int64_t total) {
  if (i + 8 <= total) {
    const __m256 v = f16 ? _mm256_cvtph_ps(_mm_loadu_si128(
                               reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)))
                         : _mm256_loadu_ps(static_cast<const float*>(p) + i);
    if (n >= 8) return v;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                _mm256_set1_epi32(static_cast<int>(n)), lane)));
  }
  alignas(32) float v[8] = {};  // the array's last groups
  for (int64_t g = 0; g < n; ++g) v[g] = scale_at(p, f16, i + g);
  return _mm256_load_ps(v);
}

// int8 weight row `row`'s scales of n (<= 8) groups of 32 columns from group c on: its one
// scale, or groups of any multiple of 32 columns.
inline __m256 int8_scales8(const Problem& pb, int64_t row, int64_t c, int64_t n) {
  if (pb.groups == 1) return _mm256_set1_ps(scale_at(pb.scales, pb.scales_f16, row));
  if (pb.groups * 32 == pb.in)
    return load_groups8(pb.scales, pb.scales_f16, row * pb.groups + c, n, pb.out * pb.groups);
  const int64_t group = pb.in / pb.groups;  // a multiple of 32 (integer_dots_fit)
  alignas(32) float s[8] = {};
  for (int64_t g = 0; g < n; ++g)
    s[g] = scale_at(pb.scales, pb.scales_f16, row * pb.groups + (c + g) * 32 / group);
  return _mm256_load_ps(s);
}

// int8 and int4 weights in a bfloat16 product by integer dots: vpmaddubsw multiplies 32
// unsigned bytes by 32 signed ones, summing pairs into 16-bit lanes, vpmaddwd sums those in
// pairs into 8 int32 lanes, exact:
//   int8 (tile_dot_int8): |w| (vpsignb of w by itself: -128 gives the byte 0x80, 128
//         unsigned) times x's bytes with w's sign (vpsignb: x is within +-127), a group of 32
//         columns a step: pairs of at most 2 128 127, below the 16-bit saturation;
//   int4 (tile_dot_int4): the 4-bit values q (unsigned, 0-15) times x's bytes, two groups a
//         step: their 32 packed bytes masked give elements 0-15 of both, shifted and masked
//         16-31 of both, against x in that order (prepare_x8's nibble order); the two
//         products' 16-bit lanes added (at most 4 15 127), lanes 0-3 of the int32 sums are
//         the first group's, 4-7 the second's.
// Each dot, converted to float32, is multiplied by its group's weight scale times x's step
// (`GroupScales`, per 8 groups); int4's minimums m sum(x) are added per 8 groups (a lane a
// group: the lanes are summed at the end anyway). Per 64 weights and row of x: int8 2
// vpsignb, 4 products, 2 conversions, 2 multiply-adds; int4 2 products, an add, a product,
// a conversion, a multiply-add; the loads and unpacking shared by the rows.
template <int RT>
struct GroupScales {
  // int8: d[r][j][0][i], group i of the 8; int4: d[r][j][i], pair i of the 4 (groups 2i and
  // 2i + 1), the first group's in lanes 0-3 and the second's in 4-7
  alignas(32) float d[RT][kOutBlock][4][8];

  // The n (<= 8) groups from group c on of weight rows `rows` and x's rows r0.. (x's steps
  // and sums are zeros past its last group); int4's minimums' term goes into sums.
  template <Kind K>
  void load(const Problem& pb, int64_t r0, const int64_t* rows, int64_t c, int64_t n,
            __m256 (&sums)[RT][kOutBlock]) {
    const int64_t total = pb.out * pb.groups;
    for (int j = 0; j < kOutBlock; ++j) {
      __m256 s, m = _mm256_setzero_ps();
      if constexpr (K == Kind::kInt4) {
        s = load_groups8(pb.scales, pb.scales_f16, rows[j] * pb.groups + c, n, total);
        m = load_groups8(pb.mins, pb.mins_f16, rows[j] * pb.groups + c, n, total);
      } else {
        s = int8_scales8(pb, rows[j], c, n);
      }
      for (int r = 0; r < RT; ++r) {
        const int64_t at = (r0 + r) * pb.x_sum_stride + c;
        const __m256 d8 = _mm256_mul_ps(s, _mm256_loadu_ps(pb.x8_scale + at));
        if constexpr (K == Kind::kInt4) {
          sums[r][j] = _mm256_fmadd_ps(m, _mm256_loadu_ps(pb.x_sum + at), sums[r][j]);
          for (int i = 0; i < 4; ++i) {
            const __m256i pair = _mm256_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1,
                                                   2 * i + 1, 2 * i + 1, 2 * i + 1);
            _mm256_store_ps(d[r][j][i], _mm256_permutevar8x32_ps(d8, pair));
          }
        } else {
          _mm256_store_ps(d[r][j][0], d8);
        }
      }
    }
  }
};

template <int RT>
void tile_dot_int8(const Problem& pb, int64_t r0, const int64_t* rows, float* acc) {
  __m256 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm256_setzero_ps();
  const int64_t groups = pb.in / 32;
  Ahead ahead(pb.w + rows[0] * pb.row_bytes, pb.row_bytes, r0 == 0);
  const __m256i ones = _mm256_set1_epi16(1);
  GroupScales<RT> scales;
  for (int64_t c = 0; c < groups; c += 8) {  // 8 groups (256 columns) at a time
    const int64_t n = std::min<int64_t>(8, groups - c);
    scales.template load<Kind::kInt8>(pb, r0, rows, c, n, sums);
    for (int64_t g = 0; g < n; ++g) {
      const int64_t k = (c + g) * 32;
      __m256i xv[RT];
      for (int r = 0; r < RT; ++r)
        xv[r] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(pb.x8 + (r0 + r) * pb.x8_stride + k));
      for (int j = 0; j < kOutBlock; ++j) {
        if (k % 64 == 0) ahead.step();  // a 64-byte line every 2 groups
        const __m256i w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(pb.w + rows[j] * pb.row_bytes + k));
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        for (int r = 0; r < RT; ++r) {
          const __m256i dot = _mm256_madd_epi16(
              _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv[r], w)), ones);
          sums[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                       _mm256_broadcast_ss(&scales.d[r][j][0][g]), sums[r][j]);
        }
      }
    }
  }
  store_sums8(sums, acc + r0 * kOutBlock);
}

template <int RT>
void tile_dot_int4(const Problem& pb, int64_t r0, const int64_t* rows, float* acc) {
  __m256 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm256_setzero_ps();
  const int64_t groups = pb.groups, row_bytes = pb.row_bytes;
  Ahead ahead(pb.w + rows[0] * row_bytes, row_bytes, r0 == 0);
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  GroupScales<RT> scales;
  for (int64_t c = 0; c < groups; c += 8) {  // 8 groups (256 columns) at a time
    const int64_t n = std::min<int64_t>(8, groups - c);
    scales.template load<Kind::kInt4>(pb, r0, rows, c, n, sums);
    for (int64_t i = 0; 2 * i < n; ++i) {  // groups c + 2i and c + 2i + 1
      const int64_t g = c + 2 * i;
      __m256i x_lo[RT], x_hi[RT];  // elements 0-15 of both groups, then 16-31
      for (int r = 0; r < RT; ++r) {
        const int8_t* x = pb.x8 + (r0 + r) * pb.x8_stride + g * 32;
        x_lo[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        x_hi[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      }
      for (int j = 0; j < kOutBlock; ++j) {
        if (g % 4 == 0) ahead.step();  // a 64-byte line every 4 groups
        const char* at = pb.w + rows[j] * row_bytes + g * 16;
        // the row's last group alone: zeros after it (x there is 0), not the next row's
        const __m256i w = g + 1 < groups
            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
            : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        const __m256i lo = _mm256_and_si256(w, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        for (int r = 0; r < RT; ++r) {
          const __m256i dot = _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo[r]),
                               _mm256_maddubs_epi16(hi, x_hi[r])),
              ones);
          sums[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                       _mm256_load_ps(scales.d[r][j][i]), sums[r][j]);
        }
      }
    }
  }
  store_sums8(sums, acc + r0 * kOutBlock);
}

inline void block_int8_dots(const Problem& pb, int64_t o, int64_t block, float* acc) {
  int64_t rows[kOutBlock];  // rows past the block repeat its first (unused sums)
  for (int j = 0; j < kOutBlock; ++j) rows[j] = o + (j < block ? j : 0);
  for_avx2_row_tiles(pb.rows, [&](auto rt, int64_t r) { tile_dot_int8<rt>(pb, r, rows, acc); });
}

inline void block_int4_dots(const Problem& pb, int64_t o, int64_t block, float* acc) {
  int64_t rows[kOutBlock];  // rows past the block repeat its first (unused sums)
  for (int j = 0; j < kOutBlock; ++j) rows[j] = o + (j < block ? j : 0);
  for_avx2_row_tiles(pb.rows, [&](auto rt, int64_t r) { tile_dot_int4<rt>(pb, r, rows, acc); });
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// x for the integer dots (tile_dot_int8, tile_dot_int4): each row rounded to bfloat16 (as XLA's dot rounds
// it), then per group of 32 columns signed bytes q times a step, the group's largest
// magnitude / 127 (llama.cpp's Q8_0 of x): q = x * (127 / largest) to nearest even, |q| <=
// 127, at most half a step off. The bytes go in column order (int8) or, per 2 groups, as
// int4's packed bytes hold them (`nibble_order`: elements 0-15 of both groups, then 16-31),
// the steps per group beside them, and x's sum per group (int4's minimums multiply it).
// Zeros past the last group, up to a whole 16 groups. (The signature is the AVX-512 one's;
// this layout needs no offsets.)
inline void prepare_x8(const float* x, Problem& pb, bool nibble_order,
                       std::vector<int8_t>& x8, std::vector<float>& x8_scale,
                       std::vector<float>& x_sum, std::vector<float>& /*x8_lanes*/,
                       std::vector<float>& /*x_offset*/) {
  const int64_t groups = pb.in / 32;  // I % 32 == 0 (integer_dots_fit)
  pb.x_sum_stride = (groups + 15) / 16 * 16;
  pb.x8_stride = pb.x_sum_stride * 32;
  x8.assign(pb.rows * pb.x8_stride, 0);
  x8_scale.assign(pb.rows * pb.x_sum_stride, 0.0f);
  x_sum.assign(pb.rows * pb.x_sum_stride, 0.0f);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i low = _mm256_set1_epi32(-128), high = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < pb.rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = x + r * pb.in + g * 32;
      __m256 v[4];
      __m256 largest8 = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
      for (int h = 0; h < 4; ++h) {
        v[h] = bf16_rounded(_mm256_loadu_ps(src + 8 * h));
        largest8 = _mm256_max_ps(largest8, _mm256_and_ps(v[h], magnitude));
        sum = _mm256_add_ps(sum, v[h]);
      }
      // vmaxps drops a NaN in its second operand: look for one apart
      bool finite = true;
      for (int h = 0; h < 4; ++h)
        finite = finite && _mm256_movemask_ps(_mm256_cmp_ps(v[h], v[h], _CMP_UNORD_Q)) == 0;
      const float largest = finite ? max8(largest8) : std::numeric_limits<float>::quiet_NaN();
      const int64_t at = r * pb.x_sum_stride + g;
      // 0 for a group of zeros; NaN for one with a NaN or an infinity (the product is then
      // NaN: its q stay 0, times the step)
      const float step = largest == 0.0f ? 0.0f : std::isfinite(largest) ? largest / 127.0f
                                                 : std::numeric_limits<float>::quiet_NaN();
      x8_scale[at] = step;
      x_sum[at] = sum8(sum);
      if (!std::isfinite(step) || step == 0.0f) continue;
      const __m256 inverse = _mm256_set1_ps(127.0f / largest);
      __m256i q[4];
      for (int h = 0; h < 4; ++h)  // to nearest even (MXCSR's default), then saturated
        q[h] = _mm256_min_epi32(
            _mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[h], inverse)), low), high);
      // 32 int32 to 32 bytes: the packs work per 128-bit lane, the permute puts them in order
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
          order);
      int8_t* row = x8.data() + r * pb.x8_stride;
      if (nibble_order) {  // per 2 groups: elements 0-15 of both, then 16-31 of both
        int8_t* pair = row + g / 2 * 64 + g % 2 * 16;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pair), _mm256_castsi256_si128(bytes));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pair + 32), _mm256_extracti128_si256(bytes, 1));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + g * 32), bytes);
      }
    }
  pb.x8 = x8.data();
  pb.x8_scale = x8_scale.data();
  pb.x_sum = x_sum.data();
}

}  // namespace ksana_linear_cpu
