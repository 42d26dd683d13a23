// linear_cpu.cc's direct paths for quantized weights: int8 and int4 dequantized in registers
// at up to kRowTile rows, and in a bfloat16 product by integer dots at any rows with the x
// they read (prepare_int8_x, prepare_int4_xq). See linear_cpu.cc's header.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "linear_cpu_common.h"

namespace ksana_linear_cpu {

#if defined(__AVX512BF16__)
constexpr bool kDirectQuant = true;

inline float scale_value(const void* p, bool f16, int64_t i) {
  return f16 ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

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
  float s[kOutBlock][2];    // int8: the scales of this step's two vectors of 16 columns
  int32_t g[2] = {-1, -1};  // and their groups
  Ahead ahead(pb.w + o * pb.row_bytes, pb.row_bytes, true);  // one tile of all rows
  // A step reads 32 bytes of each row (int8) or 16 (int4): a line every 2 or 4 steps.
  constexpr int64_t kLineColumns = K == Kind::kInt8 ? 64 : 128;
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
        if (k % kLineColumns == 0) ahead.step();
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
// int8 weights in a bfloat16 product by integer dots (vpdpwssd: 32 int16 products summed in
// pairs into 16 int32 lanes): x, rounded to bfloat16, is an int16 q times a power-of-two
// scale per 64 columns (prepare_int8_x): exact for every bfloat16 value within 2^7 of its
// 64 columns' largest, within half a step of 2^(e - 15) below that (2^e the first power of
// two above the largest); the weights widen to int16 (vpmovsxbw)
// and are not rounded at all. Each 32 (kSpan 32) or 64 columns' int32 sums go to float32
// times x's scale, and times the weights' where those change along the row (groups of 32 or
// of a multiple of 64); a row's single scale multiplies the sums at the end (kSpan 0). Per
// 64 weights and row of x that is 2 products, a conversion and a multiply-add, against the
// dequantizing path's ~18 instructions (widen, convert, scale, round to bfloat16) that left
// int8 bound by its vector work, not by its bytes.
template <int RT, int kSpan>
void tile_dot_int8_vnni(const Problem& pb, int64_t r0, const int64_t* rows, float* acc) {
  __m512 sums[RT][kOutBlock];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < kOutBlock; ++j) sums[r][j] = _mm512_setzero_ps();
  const int8_t* w[kOutBlock];
  for (int j = 0; j < kOutBlock; ++j) w[j] = reinterpret_cast<const int8_t*>(pb.w) + rows[j] * pb.in;
  const int64_t group = pb.in / pb.groups;
  const __m512i zero = _mm512_setzero_si512();
  Ahead ahead(w[0], pb.row_bytes, r0 == 0);
  for (int64_t k = 0; k < pb.in; k += 64) {
    const bool both = k + 32 < pb.in;  // I % 32 == 0 (integer_dots_fit)
    __m512 sx[RT];
    __m512i x_lo[RT], x_hi[RT];  // past I: zeros (x_q's padding)
    for (int r = 0; r < RT; ++r) {
      const int16_t* x = pb.x_q + (r0 + r) * pb.x_q_stride + k;
      sx[r] = _mm512_set1_ps(pb.x_q_scale[(r0 + r) * pb.x_q_blocks + k / 64]);
      x_lo[r] = _mm512_loadu_si512(x);
      x_hi[r] = _mm512_loadu_si512(x + 32);
    }
    for (int j = 0; j < kOutBlock; ++j) {
      ahead.step();
      const __m512i w_lo =
          _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + k)));
      const __m512i w_hi = both ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(w[j] + k + 32)))
                                : zero;
      if constexpr (kSpan == 32) {
        const int64_t g = rows[j] * pb.groups + k / group;
        const __m512 s_lo = _mm512_set1_ps(scale_value(pb.scales, pb.scales_f16, g));
        const __m512 s_hi = both ? _mm512_set1_ps(scale_value(
                                       pb.scales, pb.scales_f16, rows[j] * pb.groups + (k + 32) / group))
                                 : _mm512_setzero_ps();
        for (int r = 0; r < RT; ++r) {
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(zero, w_lo, x_lo[r]));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(zero, w_hi, x_hi[r]));
          const __m512 both_scaled = _mm512_fmadd_ps(hi, s_hi, _mm512_mul_ps(lo, s_lo));
          sums[r][j] = _mm512_fmadd_ps(both_scaled, sx[r], sums[r][j]);
        }
      } else {
        __m512 s = _mm512_set1_ps(1.0f);
        if constexpr (kSpan == 64)
          s = _mm512_set1_ps(scale_value(pb.scales, pb.scales_f16, rows[j] * pb.groups + k / group));
        for (int r = 0; r < RT; ++r) {
          const __m512i t = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, w_lo, x_lo[r]), w_hi, x_hi[r]);
          const __m512 scale = kSpan == 64 ? _mm512_mul_ps(sx[r], s) : sx[r];
          sums[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, sums[r][j]);
        }
      }
    }
  }
  float* out = acc + r0 * kOutBlock;
  store_lane_sums(sums, out);
  if constexpr (kSpan == 0)
    for (int j = 0; j < kOutBlock; ++j) {
      const float s = scale_value(pb.scales, pb.scales_f16, rows[j] * pb.groups);
      for (int r = 0; r < RT; ++r) out[r * kOutBlock + j] *= s;
    }
}

template <int kSpan>
void block_int8_vnni_span(const Problem& pb, const int64_t* rows, float* acc) {
  int64_t r = 0;  // tiles of 2 rows: 8 float accumulators and the x of both in registers
  for (; r + 2 <= pb.rows; r += 2) tile_dot_int8_vnni<2, kSpan>(pb, r, rows, acc);
  if (r < pb.rows) tile_dot_int8_vnni<1, kSpan>(pb, r, rows, acc);
}

inline void block_int8_vnni(const Problem& pb, int64_t o, int64_t block, float* acc) {
  int64_t rows[kOutBlock];  // rows past the block repeat its first (unused sums)
  for (int j = 0; j < kOutBlock; ++j) rows[j] = o + (j < block ? j : 0);
  const int64_t group = pb.in / pb.groups;
  if (pb.groups == 1) block_int8_vnni_span<0>(pb, rows, acc);
  else if (group % 64 == 0) block_int8_vnni_span<64>(pb, rows, acc);
  else block_int8_vnni_span<32>(pb, rows, acc);
}

// int4 weights in a bfloat16 product by integer dots (vpdpbusd: 64 products of an
// unsigned and a signed byte summed in fours into 16 int32 lanes): each group's 4-bit values
// q are the unsigned bytes as they are (a mask and a shift of 64 packed bytes give 128 of
// them), x the signed ones, as a 15-bit integer per group of 32 columns split in two bytes,
// 128 h + l (prepare_int4_xq), so x . q over a group is 128 (h . q) + l . q in int32, exact.
// Per 128 weights (4 groups) and row of x: 4 products, a shift, an add, a conversion, a
// permute and a multiply-add by the groups' scales (d times x's, per 16 groups, each group's
// over its 4 lanes), against
// 2 x (widen, 2 shifts, 2 ternary logics, a permute, 2 bfloat16 dots and a multiply-add) of
// the bfloat16 dots this replaced (the 4-bit values as exact bfloat16 1 + q / 16): ~1.6x
// fewer vector instructions, which bound that path (1.1-1.8x faster at 1-16 rows). The
// minimums' term m sum(x) is added per 16 groups (a lane a group: the lanes are summed at the
// end anyway). x is exact but for values below
// 2^-6 of its group's largest (those within half a step of 2^(e - 14), 2^e the first power of
// two above it).
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
    __m512 d[RT][kOutBlock];  // the 16 groups' scales times x's, a lane a group
    for (int j = 0; j < kOutBlock; ++j) {
      const int64_t gi = rows[j] * pb.groups + c;
      const __m512 dj = load_groups(pb.scales, pb.scales_f16, gi, mask);  // past the row: 0
      const __m512 m = load_groups(pb.mins, pb.mins_f16, gi, mask);
      for (int r = 0; r < RT; ++r) {
        const int64_t at = (r0 + r) * pb.x_sum_stride + c;
        d[r][j] = _mm512_mul_ps(dj, _mm512_loadu_ps(pb.x_q4_scale + at));
        sums[r][j] = _mm512_fmadd_ps(m, _mm512_loadu_ps(pb.x_sum + at), sums[r][j]);
      }
    }
    const int64_t quads = left >= 16 ? 4 : (left + 3) / 4;
    for (int64_t b = 0; b < quads; ++b) {
      const int64_t block = c / 4 + b;  // groups 4 block .. 4 block + 3
      const __m512i idx = _mm512_add_epi32(lane_group, _mm512_set1_epi32(static_cast<int>(4 * b)));
      __m512i h_lo[RT], h_hi[RT], l_lo[RT], l_hi[RT];
      for (int r = 0; r < RT; ++r) {
        const int8_t* x = pb.x_q4 + ((r0 + r) * pb.x_q4_blocks + block) * 256;
        h_lo[r] = _mm512_loadu_si512(x), h_hi[r] = _mm512_loadu_si512(x + 64);
        l_lo[r] = _mm512_loadu_si512(x + 128), l_hi[r] = _mm512_loadu_si512(x + 192);
      }
      for (int j = 0; j < kOutBlock; ++j) {
        const int64_t at = rows[j] * row_bytes + block * 64;
        const uint8_t* w = reinterpret_cast<const uint8_t*>(pb.w) + at;
        ahead.step();
        // Past the row's last group the bytes are the next row's (x there is 0, and so is
        // the product: integers), up to the matrix's end, where the load is masked.
        const __m512i bytes =
            at + 64 <= total_bytes
                ? _mm512_loadu_si512(w)
                : _mm512_maskz_loadu_epi8(~__mmask64{0} >> (64 - (total_bytes - at)), w);
        const __m512i lo = _mm512_and_si512(bytes, low4);  // elements 0-15 of the 4 groups
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);  // 16-31
        for (int r = 0; r < RT; ++r) {
          const __m512i h = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, h_lo[r]), hi, h_hi[r]);
          const __m512i l = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, l_lo[r]), hi, l_hi[r]);
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l));
          const __m512 scale = _mm512_permutexvar_ps(idx, d[r][j]);  // each group's, 4 lanes
          sums[r][j] = _mm512_fmadd_ps(dot, scale, sums[r][j]);
        }
      }
    }
  }
  store_lane_sums(sums, acc + r0 * kOutBlock);
}

inline void block_int4_vnni(const Problem& pb, int64_t o, int64_t block, float* acc) {
  int64_t rows[kOutBlock];  // rows past the block repeat its first (unused sums)
  for (int j = 0; j < kOutBlock; ++j) rows[j] = o + (j < block ? j : 0);
  int64_t r = 0;
  for (; r + 2 <= pb.rows; r += 2) tile_dot_int4_vnni<2>(pb, r, rows, acc);
  if (r < pb.rows) tile_dot_int4_vnni<1>(pb, r, rows, acc);
}

constexpr bool kVNNI = true;
#else
constexpr bool kVNNI = false;
inline void block_int8_vnni(const Problem&, int64_t, int64_t, float*) {}
inline void block_int4_vnni(const Problem&, int64_t, int64_t, float*) {}
#endif

// Whether a weight takes integer dots (where the CPU has AVX512-VNNI, in a bfloat16 product):
// int8 (tile_dot_int8_vnni) with I a multiple of 32 and groups of a multiple of 32 columns
// (or one per row); int4 (tile_dot_int4_vnni) always -- every CPU with AVX512-BF16 so far has
// VNNI; else tile_dot_quant, at up to kRowTile rows.
inline bool integer_dots_fit(const Problem& pb) {
  if (!kVNNI || !pb.bf16) return false;
  if (pb.kind == Kind::kInt4) return true;
  return pb.kind == Kind::kInt8 && pb.in % 32 == 0 &&
         (pb.groups == 1 || (pb.in / pb.groups) % 32 == 0);
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

inline void block_quant(const Problem& pb, int64_t o, int64_t block, float* acc) {
  if (pb.integer_dots && pb.kind == Kind::kInt8) {
    block_int8_vnni(pb, o, block, acc);
  } else if (pb.kind == Kind::kInt8) {
    if (pb.bf16) block_quant_rows<Kind::kInt8, true>(pb, o, block, acc);
    else block_quant_rows<Kind::kInt8, false>(pb, o, block, acc);
  } else if (pb.integer_dots) {
    block_int4_vnni(pb, o, block, acc);
  } else if (pb.bf16) {
    block_quant_rows<Kind::kInt4, true>(pb, o, block, acc);
  } else {
    block_quant_rows<Kind::kInt4, false>(pb, o, block, acc);
  }
}
#else
constexpr bool kDirectQuant = false;
inline bool integer_dots_fit(const Problem&) { return false; }
inline void block_quant(const Problem&, int64_t, int64_t, float*) {}
#endif

#if defined(__AVX512BF16__)
// 16 floats to bfloat16 and back: to nearest even, as XLA's convert.
inline __m512 bf16_rounded(__m512 f) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(f);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// The power of two 2^(e - bits + 1) whose integer multiples of magnitude below 2^(bits - 1)
// cover [-top, top] (2^e the first power of two above `top`, the largest magnitude of the
// values); 1 for top 0, NaN for a NaN or infinity (the product is then NaN).
inline float integer_step(float top, int bits) {
  if (!std::isfinite(top)) return std::numeric_limits<float>::quiet_NaN();
  if (top == 0.0f) return 1.0f;
  int e;
  std::frexp(top, &e);  // top < 2^e
  return std::ldexp(1.0f, e - bits + 1);
}

// x for tile_dot_int8_vnni: each row rounded to bfloat16 (as XLA's dot rounds it), then per
// 64 columns an int16 q and a power-of-two scale 2^(e - 15), 2^e the first power of two above
// the columns' largest magnitude: |q| < 2^15, and a bfloat16 value within 2^7 of that largest
// is exactly an integer q (one at least 2^(e - 8): its last bit is worth at least the step). Padded with zeros to whole 64 columns.
inline void prepare_int8_x(const float* x, Problem& pb, std::vector<int16_t>& x_q,
                           std::vector<float>& x_scale) {
#if defined(__AVX512BF16__)
  pb.x_q_blocks = (pb.in + 63) / 64;
  pb.x_q_stride = pb.x_q_blocks * 64;
  x_q.assign(pb.rows * pb.x_q_stride, 0);
  x_scale.assign(pb.rows * pb.x_q_blocks, 0.0f);
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < pb.rows; ++r)
    for (int64_t b = 0; b < pb.x_q_blocks; ++b) {
      const int64_t k0 = b * 64, n = std::min<int64_t>(64, pb.in - k0);
      __m512 v[4];
      __m512 largest = _mm512_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        const int64_t left = n - 16 * i;
        const __mmask16 m = left >= 16 ? 0xffff
                            : left <= 0 ? 0
                                        : static_cast<__mmask16>((1u << left) - 1);
        v[i] = bf16_rounded(_mm512_maskz_loadu_ps(m, x + r * pb.in + k0 + 16 * i));
        largest = _mm512_max_ps(largest, _mm512_and_ps(v[i], magnitude));
      }
      const float scale = integer_step(_mm512_reduce_max_ps(largest), 16);
      x_scale[r * pb.x_q_blocks + b] = scale;
      if (!std::isfinite(scale)) continue;
      const __m512 inverse = _mm512_set1_ps(1.0f / scale);  // a power of two: exact
      int16_t* q = x_q.data() + r * pb.x_q_stride + k0;
      for (int i = 0; i < 4; ++i)  // to nearest even (MXCSR's default), then to int16
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * i),
                            _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse))));
    }
  pb.x_q = x_q.data();
  pb.x_q_scale = x_scale.data();
#endif
}

// x for tile_dot_int4_vnni: each row rounded to bfloat16 (as XLA's dot rounds it), its sums
// per group of 32 columns (Problem::x_sum), then per group an integer q = 128 h + l, |q| <
// 2^14, times a power-of-two scale 2^(e - 14), 2^e the first power of two above the group's
// largest magnitude (a bfloat16 value within 2^6 of that largest is exactly such a q). Per 4
// groups 256 bytes: h of the groups' elements 0-15 (the low nibbles' order: group after
// group), h of elements 16-31, then l the same way; zeros past the last group. The scales
// go beside the sums ([R, x_sum_stride]).
inline void prepare_int4_xq(const float* x, Problem& pb, std::vector<int8_t>& x_q4,
                            std::vector<float>& x_q4_scale, std::vector<float>& x_sum) {
#if defined(__AVX512BF16__)
  pb.x_q4_blocks = (pb.groups + 3) / 4;
  pb.x_sum_stride = (pb.groups + 15) / 16 * 16;
  x_q4.assign(pb.rows * pb.x_q4_blocks * 256, 0);
  x_q4_scale.assign(pb.rows * pb.x_sum_stride, 0.0f);
  x_sum.assign(pb.rows * pb.x_sum_stride, 0.0f);
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512i seven_bits = _mm512_set1_epi32(127);
  for (int64_t r = 0; r < pb.rows; ++r)
    for (int64_t g = 0; g < pb.groups; ++g) {
      const float* src = x + r * pb.in + g * 32;
      __m512 v[2];
      for (int h = 0; h < 2; ++h) v[h] = bf16_rounded(_mm512_loadu_ps(src + 16 * h));
      x_sum[r * pb.x_sum_stride + g] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      const float scale = integer_step(_mm512_reduce_max_ps(_mm512_max_ps(
                                           _mm512_and_ps(v[0], magnitude), _mm512_and_ps(v[1], magnitude))),
                                       15);
      x_q4_scale[r * pb.x_sum_stride + g] = scale;
      if (!std::isfinite(scale)) continue;
      const int64_t block = r * pb.x_q4_blocks + g / 4, slot = g % 4;
      const __m512 inverse = _mm512_set1_ps(1.0f / scale);  // a power of two: exact
      int8_t* dst = x_q4.data() + block * 256 + slot * 16;
      for (int h = 0; h < 2; ++h) {  // to nearest even (MXCSR's default), then split
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], inverse));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64 * h),
                         _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 7)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 128 + 64 * h),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(q, seven_bits)));
      }
    }
  pb.x_q4 = x_q4.data();
  pb.x_q4_scale = x_q4_scale.data();
  pb.x_sum = x_sum.data();
#endif
}

}  // namespace ksana_linear_cpu
