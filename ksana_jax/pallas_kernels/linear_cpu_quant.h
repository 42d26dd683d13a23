// linear_cpu.cc's direct paths for quantized weights: int8 and int4 dequantized in registers
// at up to kRowTile rows, and in a bfloat16 product by integer dots at any rows with the x
// they read (prepare_x8). See linear_cpu.cc's header.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "linear_cpu_common.h"
#if defined(KSANA_LINEAR_AVX2)
#include "linear_cpu_avx2.h"
#endif

namespace ksana_linear_cpu {

#if defined(__AVX512BF16__)
constexpr bool kDirectQuant = true;


// int8 and int4 weights at up to kRowTile rows of x (where integer dots do not apply): each 32 columns
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
  Int8StepScales scales;  // int8's
  Ahead ahead(pb.w + o * pb.row_bytes, pb.row_bytes, true);  // one tile of all rows
  // A step reads 32 bytes of each row (int8) or 16 (int4): a line every 2 or 4 steps.
  constexpr int64_t kLineColumns = K == Kind::kInt8 ? 64 : 128;
  for (int64_t k = 0; k < pb.in; k += 32) {
    __m512 lo[kOutBlock], hi[kOutBlock];  // columns k..k+15 and k+16..k+31
    if constexpr (K == Kind::kInt8) {
      scales.at(pb, rows, k);
      const int64_t left = pb.in - k;
      const __mmask16 m_lo = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m_hi =
          left >= 32 ? 0xffff : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
      for (int j = 0; j < kOutBlock; ++j) {
        const int8_t* w = reinterpret_cast<const int8_t*>(pb.w) + rows[j] * pb.in + k;
        if (k % kLineColumns == 0) ahead.step();
        // Masked loads only at the tail: from memory they were ~10x slower here.
        const __m128i b_lo = left >= 32 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w))
                                        : _mm_maskz_loadu_epi8(m_lo, w);
        const __m128i b_hi = left >= 32
                                 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))
                                 : _mm_maskz_loadu_epi8(m_hi, w + 16);
        lo[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b_lo)),
                              _mm512_set1_ps(scales.s[j][0]));
        hi[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b_hi)),
                              _mm512_set1_ps(scales.s[j][1]));
      }
    } else {  // int4: I % 32 == 0, one group a step (GGUF Q4_1's nibbles, see the top)
      const __m128i low4 = _mm_set1_epi8(0xF);
      for (int j = 0; j < kOutBlock; ++j) {
        const int64_t gi = rows[j] * pb.groups + k / 32;
        const __m512 sc = _mm512_set1_ps(scale_at(pb.scales, pb.scales_f16, gi));
        const __m512 mn = _mm512_set1_ps(scale_at(pb.mins, pb.mins_f16, gi));
        const uint8_t* w = reinterpret_cast<const uint8_t*>(pb.w) + (rows[j] * pb.in + k) / 2;
        if (k % kLineColumns == 0) ahead.step();
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
  store_lane_sums(sums, acc);
}

// 16 groups' scales or minimums from group i on (masked: zeros past the row's last).
inline __m512 load_groups(const void* p, bool f16, int64_t i, __mmask16 mask) {
  if (f16) {
    const uint16_t* h = static_cast<const uint16_t*>(p) + i;
    return _mm512_cvtph_ps(mask == 0xffff ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))
                                          : _mm256_maskz_loadu_epi16(mask, h));
  }
  const float* f = static_cast<const float*>(p) + i;
  return mask == 0xffff ? _mm512_loadu_ps(f) : _mm512_maskz_loadu_ps(mask, f);
}

#if defined(__AVX512VNNI__)
// 64 bytes of a weight from byte `at` on; past its end (`total` bytes) zeros, not read.
inline __m512i weight_bytes64(const char* w, int64_t at, int64_t total) {
  return at + 64 <= total
             ? _mm512_loadu_si512(w + at)
             : _mm512_maskz_loadu_epi8(~__mmask64{0} >> (64 - (total - at)), w + at);
}

// The weights' scales of 16 groups of 32 columns from group c on, a lane a group (masked:
// zeros past the row's last): int8's one scale a row, or groups of any multiple of 32 columns.
inline __m512 int8_scales16(const Problem& pb, int64_t row, int64_t c, __mmask16 mask) {
  if (pb.groups == 1) return _mm512_set1_ps(scale_at(pb.scales, pb.scales_f16, row));
  const int64_t group = pb.in / pb.groups;  // a multiple of 32 (integer_dots_fit)
  if (group == 32) return load_groups(pb.scales, pb.scales_f16, row * pb.groups + c, mask);
  alignas(64) float s[16] = {};
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1)
      s[i] = scale_at(pb.scales, pb.scales_f16, row * pb.groups + (c + i) * 32 / group);
  return _mm512_load_ps(s);
}

// int8 weights in a bfloat16 product by integer dots (vpdpbusd: 64 products of an unsigned
// and a signed byte summed in fours into 16 int32 lanes): the weights as the unsigned bytes
// w + 128 (their sign bit flipped), x as the signed ones (prepare_x8: 8-bit integers per group
// of 32 columns, in column order), so 64 bytes of a weight row are one product per row of x,
// lanes 0-7 one group's and 8-15 the next's; x . w over a group is that sum minus 128 sum(q),
// times x's step and the weights' scale. With one scale a row (kRowScale) the lanes take x's
// steps as they are (x8_lanes) and the row's scale and x's -128 sum(step q) (x_offset) apply
// once at the end: per 64 weights and row of x a product, a conversion and a multiply-add,
// and a load and an xor shared by the rows, against 2 widenings, 2 int16 products, a
// conversion and a multiply-add (x as 16-bit integers per 64 columns) before -- int8 was
// bound by them. With groups, each group's scale times x's step goes over its 8 lanes (a
// permute of 16 groups' products) and -128 sum(q) per group beside them (x_sum).
template <int RT, bool kRowScale>
void tile_dot_int8_vnni(const Problem& pb, int64_t r0, const int64_t* rows, float* acc) {
  __m512 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm512_setzero_ps();
  const int64_t total_bytes = pb.out * pb.in, x_groups = pb.in / 32;
  Ahead ahead(pb.w + rows[0] * pb.row_bytes, pb.row_bytes, r0 == 0);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  const __m512i lane_pair = _mm512_srli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
  for (int64_t c = 0; c < x_groups; c += 16) {  // 16 groups (512 columns) at a time
    const int64_t left = x_groups - c;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    __m512 d[RT][kOutBlock];  // the 16 groups' scales times x's steps, a lane a group
    if constexpr (!kRowScale)
      for (int j = 0; j < kOutBlock; ++j) {
        const __m512 wj = int8_scales16(pb, rows[j], c, mask);
        for (int r = 0; r < RT; ++r) {
          const int64_t at = (r0 + r) * pb.x_sum_stride + c;
          d[r][j] = _mm512_mul_ps(wj, _mm512_loadu_ps(pb.x8_scale + at));
          sums[r][j] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(pb.x_sum + at), sums[r][j]);
        }
      }
    const int64_t pairs = left >= 16 ? 8 : (left + 1) / 2;
    for (int64_t b = 0; b < pairs; ++b) {
      const int64_t k = (c + 2 * b) * 32;  // groups c + 2b and c + 2b + 1
      const __m512i idx = _mm512_add_epi32(lane_pair, _mm512_set1_epi32(static_cast<int>(2 * b)));
      __m512i xv[RT];  // past the last group: zeros
      __m512 steps[RT];
      for (int r = 0; r < RT; ++r) {
        xv[r] = _mm512_loadu_si512(pb.x8 + (r0 + r) * pb.x8_stride + k);
        if constexpr (kRowScale)
          steps[r] = _mm512_loadu_ps(pb.x8_lanes + (r0 + r) * 8 * pb.x_sum_stride + k / 4);
      }
      for (int j = 0; j < kOutBlock; ++j) {
        ahead.step();
        // Past the row's last group the bytes are the next row's (x there is 0, and so is
        // the product), up to the matrix's end (weight_bytes64).
        const __m512i bytes = weight_bytes64(pb.w, rows[j] * pb.in + k, total_bytes);
        const __m512i offset = _mm512_xor_si512(bytes, flip);  // w + 128, unsigned
        for (int r = 0; r < RT; ++r) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, offset, xv[r]));
          const __m512 scale = kRowScale ? steps[r] : _mm512_permutexvar_ps(idx, d[r][j]);
          sums[r][j] = _mm512_fmadd_ps(dot, scale, sums[r][j]);
        }
      }
    }
  }
  float* out = acc + r0 * kOutBlock;
  store_lane_sums(sums, out);
  if constexpr (kRowScale)
    for (int j = 0; j < kOutBlock; ++j) {
      const float s = scale_at(pb.scales, pb.scales_f16, rows[j]);
      for (int r = 0; r < RT; ++r) {
        float& y = out[r * kOutBlock + j];
        y = (y + pb.x_offset[r0 + r]) * s;
      }
    }
}

template <bool kRowScale>
void block_int8_vnni_tiles(const Problem& pb, const int64_t* rows, float* acc) {
  int64_t r = 0;  // tiles of 2 rows: 8 float accumulators and the x of both in registers
  for (; r + 2 <= pb.rows; r += 2) tile_dot_int8_vnni<2, kRowScale>(pb, r, rows, acc);
  if (r < pb.rows) tile_dot_int8_vnni<1, kRowScale>(pb, r, rows, acc);
}

inline void block_int8_dots(const Problem& pb, int64_t o, int64_t block, float* acc) {
  int64_t rows[kOutBlock];  // rows past the block repeat its first (unused sums)
  for (int j = 0; j < kOutBlock; ++j) rows[j] = o + (j < block ? j : 0);
  if (pb.groups == 1) block_int8_vnni_tiles<true>(pb, rows, acc);
  else block_int8_vnni_tiles<false>(pb, rows, acc);
}

// int4 weights in a bfloat16 product by integer dots (vpdpbusd: 64 products of an
// unsigned and a signed byte summed in fours into 16 int32 lanes): each group's 4-bit values
// q are the unsigned bytes as they are (a mask and a shift of 64 packed bytes give 128 of
// them), x the signed ones (prepare_x8: 8-bit integers per group of 32 columns, in the
// nibbles' order), so x . q over 4 groups is 2 products in int32, exact. Per 128 weights
// (4 groups) and row of x: 2 products, a conversion, a permute and a multiply-add by the
// groups' scales (d times x's steps, per 16 groups, each group's over its 4 lanes); a mask, a
// shift and a mask shared by the rows. x as 15-bit integers (two bytes, 128 h + l) took 2
// products, a shift and an add more; the bfloat16 dots before them (the 4-bit values as
// exact bfloat16 1 + q / 16) ~1.6x more again: the vector work bounds this path. The
// minimums' term m sum(x) is added per 16 groups (a lane a group: the lanes are summed at the
// end anyway), by x's own sums.
template <int RT>
void tile_dot_int4_vnni(const Problem& pb, int64_t r0, const int64_t* rows, float* acc) {
  __m512 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm512_setzero_ps();
  const int64_t row_bytes = pb.row_bytes, total_bytes = pb.out * row_bytes;
  Ahead ahead(pb.w + rows[0] * row_bytes, row_bytes, r0 == 0);
  const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const __m512i lane_group = _mm512_srli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
  for (int64_t c = 0; c < pb.groups; c += 16) {  // 16 groups (512 columns) at a time
    const int64_t left = pb.groups - c;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    __m512 d[RT][kOutBlock];  // the 16 groups' scales times x's steps, a lane a group
    for (int j = 0; j < kOutBlock; ++j) {
      const int64_t gi = rows[j] * pb.groups + c;
      const __m512 dj = load_groups(pb.scales, pb.scales_f16, gi, mask);  // past the row: 0
      const __m512 m = load_groups(pb.mins, pb.mins_f16, gi, mask);
      for (int r = 0; r < RT; ++r) {
        const int64_t at = (r0 + r) * pb.x_sum_stride + c;
        d[r][j] = _mm512_mul_ps(dj, _mm512_loadu_ps(pb.x8_scale + at));
        sums[r][j] = _mm512_fmadd_ps(m, _mm512_loadu_ps(pb.x_sum + at), sums[r][j]);
      }
    }
    const int64_t quads = left >= 16 ? 4 : (left + 3) / 4;
    for (int64_t b = 0; b < quads; ++b) {
      const int64_t block = c / 4 + b;  // groups 4 block .. 4 block + 3
      const __m512i idx = _mm512_add_epi32(lane_group, _mm512_set1_epi32(static_cast<int>(4 * b)));
      __m512i x_lo[RT], x_hi[RT];  // the groups' elements 0-15, then 16-31
      for (int r = 0; r < RT; ++r) {
        const int8_t* x = pb.x8 + (r0 + r) * pb.x8_stride + block * 128;
        x_lo[r] = _mm512_loadu_si512(x), x_hi[r] = _mm512_loadu_si512(x + 64);
      }
      for (int j = 0; j < kOutBlock; ++j) {
        ahead.step();
        // Past the row's last group the bytes are the next row's (x there is 0, and so is
        // the product: integers), up to the matrix's end (weight_bytes64).
        const __m512i bytes = weight_bytes64(pb.w, rows[j] * row_bytes + block * 64, total_bytes);
        const __m512i lo = _mm512_and_si512(bytes, low4);  // elements 0-15 of the 4 groups
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);  // 16-31
        for (int r = 0; r < RT; ++r) {
          const __m512 dot = _mm512_cvtepi32_ps(
              _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, x_lo[r]), hi, x_hi[r]));
          const __m512 scale = _mm512_permutexvar_ps(idx, d[r][j]);  // each group's, 4 lanes
          sums[r][j] = _mm512_fmadd_ps(dot, scale, sums[r][j]);
        }
      }
    }
  }
  store_lane_sums(sums, acc + r0 * kOutBlock);
}

inline void block_int4_dots(const Problem& pb, int64_t o, int64_t block, float* acc) {
  int64_t rows[kOutBlock];  // rows past the block repeat its first (unused sums)
  for (int j = 0; j < kOutBlock; ++j) rows[j] = o + (j < block ? j : 0);
  int64_t r = 0;
  for (; r + 2 <= pb.rows; r += 2) tile_dot_int4_vnni<2>(pb, r, rows, acc);
  if (r < pb.rows) tile_dot_int4_vnni<1>(pb, r, rows, acc);
}

constexpr bool kIntegerDots = true;
#else
constexpr bool kIntegerDots = false;
inline void block_int8_dots(const Problem&, int64_t, int64_t, float*) {}
inline void block_int4_dots(const Problem&, int64_t, int64_t, float*) {}
#endif

template <Kind K, bool kBF16>
void block_quant_rows(const Problem& pb, int64_t o, int64_t block, float* acc) {
  switch (pb.rows) {
    case 4: tile_dot_quant<4, K, kBF16>(pb, o, block, acc); break;
    case 3: tile_dot_quant<3, K, kBF16>(pb, o, block, acc); break;
    case 2: tile_dot_quant<2, K, kBF16>(pb, o, block, acc); break;
    default: tile_dot_quant<1, K, kBF16>(pb, o, block, acc); break;
  }
}


// 16 floats to bfloat16 and back: to nearest even, as XLA's convert.
inline __m512 bf16_rounded(__m512 f) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(f);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x for the integer dots (tile_dot_int8_vnni, tile_dot_int4_vnni): each row rounded to
// bfloat16 (as XLA's dot rounds it), then per group of 32 columns signed bytes q times a
// step, the group's largest magnitude / 127 (llama.cpp's Q8_0 of x): q = x * (127 / largest)
// to nearest even, |q| <= 127, at most half a step off. The bytes go in column order (int8)
// or, per 4 groups, as the nibbles of int4's packed bytes hold them (`nibble_order`: elements
// 0-15 of the 4 groups, group after group, then 16-31); beside them per group the step and a
// sum: int4's x's sum (the minimums multiply it), int8's -128 step sum(q) (its weights' bytes
// are w + 128). Zeros past the last group, up to a whole 16 groups.
inline void prepare_x8(const float* x, Problem& pb, bool nibble_order, std::vector<int8_t>& x8,
                       std::vector<float>& x8_scale, std::vector<float>& x_sum,
                       std::vector<float>& x8_lanes, std::vector<float>& x_offset) {
  const int64_t groups = pb.in / 32;  // I % 32 == 0 (integer_dots_fit)
  pb.x_sum_stride = (groups + 15) / 16 * 16;
  pb.x8_stride = pb.x_sum_stride * 32;
  x8.assign(pb.rows * pb.x8_stride, 0);
  x8_scale.assign(pb.rows * pb.x_sum_stride, 0.0f);
  x_sum.assign(pb.rows * pb.x_sum_stride, 0.0f);
  if (!nibble_order) {
    x8_lanes.assign(pb.rows * 8 * pb.x_sum_stride, 0.0f);
    x_offset.assign(pb.rows, 0.0f);
  }
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512i low = _mm512_set1_epi32(-128), high = _mm512_set1_epi32(127);
  for (int64_t r = 0; r < pb.rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = x + r * pb.in + g * 32;
      __m512 v[2];
      for (int h = 0; h < 2; ++h) v[h] = bf16_rounded(_mm512_loadu_ps(src + 16 * h));
      const int64_t at = r * pb.x_sum_stride + g;
      const float largest = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_and_ps(v[0], magnitude), _mm512_and_ps(v[1], magnitude)));
      // 0 for a group of zeros; NaN for one with a NaN or an infinity (the product is then
      // NaN: its q stay 0, times the step)
      const float step = largest == 0.0f ? 0.0f : std::isfinite(largest) ? largest / 127.0f
                                                 : std::numeric_limits<float>::quiet_NaN();
      x8_scale[at] = step;
      if (!nibble_order) std::fill_n(x8_lanes.begin() + 8 * at, 8, step);
      if (nibble_order) x_sum[at] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      if (!std::isfinite(step) || step == 0.0f) continue;
      const __m512 inverse = _mm512_set1_ps(127.0f / largest);
      int8_t* row = x8.data() + r * pb.x8_stride;
      __m512i q_sum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {  // to nearest even (MXCSR's default), then saturated
        const __m512i q = _mm512_min_epi32(
            _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[h], inverse)), low), high);
        q_sum = _mm512_add_epi32(q_sum, q);
        int8_t* dst =
            nibble_order ? row + g / 4 * 128 + g % 4 * 16 + 64 * h : row + g * 32 + 16 * h;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q));
      }
      if (!nibble_order) {
        x_sum[at] = -128.0f * step * static_cast<float>(_mm512_reduce_add_epi32(q_sum));
        x_offset[r] += x_sum[at];
      }
    }
  pb.x8 = x8.data();
  pb.x8_lanes = x8_lanes.data();
  pb.x_offset = x_offset.data();
  pb.x8_scale = x8_scale.data();
  pb.x_sum = x_sum.data();
}

#elif defined(KSANA_LINEAR_AVX2)
// linear_cpu_avx2.h's integer dots (block_int8_dots, block_int4_dots, prepare_x8) and, without
// them, its tile_dot_quant at up to kRowTile rows.
constexpr bool kDirectQuant = true;
constexpr bool kIntegerDots = true;
template <Kind K, bool kBF16>
void block_quant_rows(const Problem& pb, int64_t o, int64_t block, float* acc) {
  switch (pb.rows) {  // up to kRowTile: 2, or 4 on a CPU with AVX-512F (32 registers)
    case 4: tile_dot_quant<4, K, kBF16>(pb, o, block, acc); break;
    case 3: tile_dot_quant<3, K, kBF16>(pb, o, block, acc); break;
    case 2: tile_dot_quant<2, K, kBF16>(pb, o, block, acc); break;
    default: tile_dot_quant<1, K, kBF16>(pb, o, block, acc); break;
  }
}
#else
constexpr bool kDirectQuant = false;
constexpr bool kIntegerDots = false;
template <Kind K, bool kBF16>
void block_quant_rows(const Problem&, int64_t, int64_t, float*) {}
inline void block_int8_dots(const Problem&, int64_t, int64_t, float*) {}
inline void block_int4_dots(const Problem&, int64_t, int64_t, float*) {}
inline void prepare_x8(const float*, Problem&, bool, std::vector<int8_t>&, std::vector<float>&,
                       std::vector<float>&, std::vector<float>&, std::vector<float>&) {}
#endif

// Whether a weight takes integer dots (where the CPU has AVX512-VNNI or AVX2, in a bfloat16
// product): int8 (tile_dot_int8_vnni, linear_cpu_avx2.h's tile_dot_int8) with I a multiple
// of 32 and groups of a multiple of 32 columns (or one per row); int4 (tile_dot_int4_vnni,
// tile_dot_int4) always -- every CPU with AVX512-BF16 so far has VNNI; else tile_dot_quant
// at up to kRowTile rows with AVX512-BF16, or the chunked path.
inline bool integer_dots_fit(const Problem& pb) {
  if (!kIntegerDots || !pb.bf16) return false;
  if (pb.kind == Kind::kInt4) return true;
  return pb.kind == Kind::kInt8 && pb.in % 32 == 0 &&
         (pb.groups == 1 || (pb.in / pb.groups) % 32 == 0);
}

inline void block_quant(const Problem& pb, int64_t o, int64_t block, float* acc) {
  if (pb.integer_dots && pb.kind == Kind::kInt8) {
    block_int8_dots(pb, o, block, acc);
  } else if (pb.kind == Kind::kInt8) {
    if (pb.bf16) block_quant_rows<Kind::kInt8, true>(pb, o, block, acc);
    else block_quant_rows<Kind::kInt8, false>(pb, o, block, acc);
  } else if (pb.integer_dots) {
    block_int4_dots(pb, o, block, acc);
  } else if (pb.bf16) {
    block_quant_rows<Kind::kInt4, true>(pb, o, block, acc);
  } else {
    block_quant_rows<Kind::kInt4, false>(pb, o, block, acc);
  }
}
}  // namespace ksana_linear_cpu
