// Small-batch linear layers for CPUs, an XLA FFI custom call:
//     y f32[R, O] = x f32[R, I] . W[O, I]^T, or residual + rms_norm(x) . W^T
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
// bfloat16 (vdpbf16ps), int8 and int4 in a bfloat16 product at any rows by
// integer dots where the CPU has AVX512-VNNI (x as 8-bit integers per group of 32 columns
// against int8's bytes plus 128, tile_dot_int8_vnni, or int4's 4-bit values, the scales and
// minimums applied per group after the dot, tile_dot_int4_vnni), and int8 / int4 otherwise
// at up to kRowTile rows -- multiply the block's rows straight from memory (dequantized in
// registers), prefetching the bytes after the block in address order (Ahead). A CPU with
// AVX2 but not AVX512-BF16 has its own direct paths for bfloat16, for int8 / int4 by
// integer dots and, without them, for int8 / int4 dequantized in registers at up to
// kRowTile rows (linear_cpu_avx2.h). bfloat16 past kAmxFromRows rows on a CPU with AMX runs
// on its tiles (run_rows_amx). float32 with AVX-512 has a path of its own (run_rows_f32:
// one multiply-add a column, in order, 16 weight rows at a time). Otherwise (more rows
// without integer dots, or neither) each block goes kChunk columns at a time:
//   phase 1  dequantize the block's chunk to float32 in registers (bfloat16 by a shift,
//            int8 / int4 by a convert and a multiply-add), stored to an L1 scratch;
//   phase 2  for every kRowTile of x's rows (read from L1 / L2), a register tile of
//            kRowTile x kOutBlock float32 vector accumulators, summed across lanes at the
//            end of the chunk.
// A decoder layer's RMS norm before its q/k/v and gate/up products and its residual add after
// its output and down products are XLA:CPU thunks of their own otherwise (~11 of a layer's
// ~19 at batch 1, each a microsecond or two of a step's few milliseconds); here the caller
// norms x's few rows before the product, and store_block adds the residual. So with the
// gated MLP's act(gate) * up before the down product: the caller computes it from the
// gate/up product's pairs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_pool.h"
#include "linear_cpu_common.h"
#include "linear_cpu_quant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace ksana_linear_cpu;  // NOLINT: this file's own helpers

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
  Ahead ahead(w[0], pb.row_bytes, r0 == 0);
  for (int64_t k = 0; k < pb.in; k += 32) {
    __m512i wv[kOutBlock];
    for (int j = 0; j < kOutBlock; ++j) {
      ahead.step();
      wv[j] = k < full ? _mm512_loadu_si512(w[j] + k) : _mm512_maskz_loadu_epi16(tail, w[j] + k);
    }
    for (int r = 0; r < RT; ++r) {
      const __m512i xv = _mm512_loadu_si512(pb.x_bf16 + (r0 + r) * pb.x_bf16_stride + k);
      for (int j = 0; j < kOutBlock; ++j)
        sums[r][j] = _mm512_dpbf16_ps(sums[r][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  store_lane_sums(sums, acc + r0 * kOutBlock);
}

void block_bf16(const Problem& pb, int64_t o, int64_t block, float* acc) {
  const uint16_t* w[kOutBlock];
  for (int j = 0; j < kOutBlock; ++j)  // rows past the block repeat its first (unused sums)
    w[j] = reinterpret_cast<const uint16_t*>(pb.w) + (o + (j < block ? j : 0)) * pb.in;
  for_row_tiles(pb.rows, [&](auto rt, int64_t r) { tile_dot_bf16<rt>(pb, r, w, acc); });
}
#elif defined(KSANA_LINEAR_AVX2)
constexpr bool kDotBF16 = true;  // block_bf16: linear_cpu_avx2.h's
#else
constexpr bool kDotBF16 = false;
void block_bf16(const Problem&, int64_t, int64_t, float*) {}
#endif

#if defined(__AVX512F__)
constexpr bool kF32Path = true;

// r[i] element j -> r[j] element i, for 16 x 16 32-bit values (bit-exact shuffles).
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto pd = [](__m512 v) { return _mm512_castps_pd(v); };
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit lane l: column 4l + c, rows 4i .. 4i + 3
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
}

// Sums sums[n * stride + lane] (weight row o + n, x row r0 + lane), n < count, folded into
// the item's maxima of x rows [r0, r0 + 16): Argmax::fold, 16 rows a vector.
inline void fold16(const Argmax& best, const float* sums, int64_t stride, int64_t count,
                   int64_t o, int64_t r0) {
  __m512 value = _mm512_loadu_ps(best.value + r0);
  __m512i index = _mm512_loadu_si512(best.index + r0);
  for (int64_t n = 0; n < count; ++n) {
    const __m512 v = _mm512_loadu_ps(sums + n * stride);
    const __mmask16 larger = _mm512_cmp_ps_mask(v, value, _CMP_GT_OQ);
    value = _mm512_mask_mov_ps(value, larger, v);
    index = _mm512_mask_mov_epi32(index, larger, _mm512_set1_epi32(static_cast<int32_t>(o + n)));
  }
  _mm512_storeu_ps(best.value + r0, value);
  _mm512_storeu_si512(best.index + r0, index);
}

// float32 weights, at 2-64 rows (linear_cpu.py's MIN_ROWS, MAX_ROWS): y[r][o] sums x[r][k]
// w[o][k] one column at a time, a multiply-add each from zero, in column order -- so a row's
// sums do not depend on the rows beside it, and they are XLA's own where its dot sums the
// same way (YNNPACK at I 128 and 2+ rows: bit-equal). x's rows are the vector lanes (x
// transposed once a call, Problem::x_t) and each weight element is broadcast as it lies,
// where XLA's dot repacked (transposed) every weight on every call: 19% of the tiny float32
// model's 64-row decode step (host_overhead.py).
//
// x's rows go in passes of 32 (an x_t pair) over a stretch of the weight that stays in L2
// (kF32StretchBytes: read from memory by the first pass, from L2 by the second), in panels
// of kF32Panel rows. So y is written 32 rows at a time: one pass over all 64 rows (4 x 4
// accumulator tiles) wrote 64 rows' streams at once and was 1.1-1.2x slower for an LM head
// [49152, 128] at 64 rows (once the stores were left out, it ran at 2 multiply-adds a cycle),
// and a pass over the whole weight each 32 rows was 0.83x for [49152, 576].
constexpr int64_t kF32Panel = 64;
constexpr int64_t kF32StretchBytes = 512 << 10;

// `buffer` resized to hold n floats from its first 64-byte boundary, which it returns (a
// vector load across two cache lines costs two).
inline float* aligned_floats(std::vector<float>& buffer, int64_t n) {
  buffer.resize(n + 15);
  return buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) / 4 & 15);
}

// c[weight row - o][x row - 16 g] (rows 32 apart) for weight rows [o, o + 16) (past o_end:
// the first's, not stored) and x rows [16 g, 16 (g + RV)), g even, NB weight rows at a time
// (NB RV = 16 accumulators). `ahead`: the next block's rows, prefetched in address order, one
// line a column of the first NB rows (16 rows are I lines), or null.
template <int NB, int RV>
void f32_block(const Problem& pb, int64_t o, int64_t o_end, int64_t g, float* c,
               const char* ahead) {
  const float* w0 = reinterpret_cast<const float*>(pb.w);
  for (int s = 0; s < 16; s += NB) {
    const float* w[NB];
    for (int n = 0; n < NB; ++n) w[n] = w0 + (o + s + n < o_end ? o + s + n : o) * pb.in;
    __m512 acc[NB][RV];
    for (int n = 0; n < NB; ++n)
      for (int v = 0; v < RV; ++v) acc[n][v] = _mm512_setzero_ps();
    const float* xt = pb.x_t + g / 2 * pb.in * 32;
    for (int64_t k = 0; k < pb.in; ++k, xt += 32) {
      if (ahead != nullptr && s == 0) _mm_prefetch(ahead + 64 * k, _MM_HINT_T0);
      __m512 xv[RV];
      for (int v = 0; v < RV; ++v) xv[v] = _mm512_load_ps(xt + 16 * v);
      for (int n = 0; n < NB; ++n) {
        const __m512 wv = _mm512_set1_ps(w[n][k]);
        for (int v = 0; v < RV; ++v) acc[n][v] = _mm512_fmadd_ps(wv, xv[v], acc[n][v]);
      }
    }
    for (int n = 0; n < NB; ++n)
      for (int v = 0; v < RV; ++v) _mm512_store_ps(c + (s + n) * 32 + 16 * v, acc[n][v]);
  }
}

// A panel's sums in c (weight rows [p, p_end), x rows [16 g, 16 (g + rv))) to y (plus the
// residual): c's 16 x 16 squares, transposed, are y's rows. Or into `best`.
void store_panel_f32(const Problem& pb, const float* c, int64_t p, int64_t p_end, int64_t g,
                     int64_t rv, const Argmax& best) {
  if (best.value) {
    for (int64_t v = 0; v < rv; ++v) fold16(best, c + 16 * v, 32, p_end - p, p, 16 * (g + v));
    return;
  }
  for (int64_t o = p; o < p_end; o += 16) {
    const __mmask16 columns = static_cast<__mmask16>((1u << std::min<int64_t>(16, p_end - o)) - 1);
    for (int64_t v = 0; v < rv; ++v) {
      __m512 t[16];
      const float* square = c + (o - p) * 32 + 16 * v;
      for (int n = 0; n < 16; ++n) t[n] = _mm512_load_ps(square + n * 32);
      transpose16(t);
      for (int64_t m = 0, r = 16 * (g + v); m < 16 && r < pb.rows; ++m, ++r) {
        const int64_t i = r * pb.out + o;
        if (pb.residual)
          t[m] = _mm512_add_ps(_mm512_maskz_loadu_ps(columns, pb.residual + i), t[m]);
        _mm512_mask_storeu_ps(pb.y + i, columns, t[m]);
      }
    }
  }
}

// Weight rows [o_begin, o_end) of a float32 product, results (plus the residual) to y, or
// into `best`.
void run_rows_f32(const Problem& pb, int64_t o_begin, int64_t o_end, const Argmax& best) {
  static thread_local std::vector<float> buffer;
  float* c = aligned_floats(buffer, kF32Panel * 32);  // c: [panel row][x row of the pass]
  const int64_t groups = (pb.rows + 15) / 16;
  const int64_t stretch =
      std::max(kF32Panel, kF32StretchBytes / pb.row_bytes / kF32Panel * kF32Panel);
  for (int64_t s = o_begin; s < o_end; s += stretch) {
    const int64_t s_end = std::min(o_end, s + stretch);
    for (int64_t g = 0; g < groups; g += 2) {  // a pass: x rows [16 g, 16 g + 32)
      const int64_t rv = std::min<int64_t>(groups - g, 2);
      for (int64_t p = s; p < s_end; p += kF32Panel) {
        const int64_t p_end = std::min(s_end, p + kF32Panel);
        for (int64_t o = p; o < p_end; o += 16) {
          const char* ahead = g == 0 ? pb.w + (o + 16) * pb.row_bytes : nullptr;
          float* block = c + (o - p) * 32;
          if (rv == 2) f32_block<8, 2>(pb, o, p_end, g, block, ahead);
          else f32_block<16, 1>(pb, o, p_end, g, block, ahead);
        }
        store_panel_f32(pb, c, p, p_end, g, rv, best);
      }
    }
  }
}

// x [R, I] into x_t: per 32 rows (zeros past R) [I][32], 16 x 16 squares at a time, in
// `buffer` (aligned_floats), which it returns: a pair of row groups' columns adjacent, one
// stream a pair.
const float* transpose_x(const float* x, int64_t rows, int64_t in, std::vector<float>& buffer) {
  const int64_t pairs = (rows + 31) / 32;
  float* out = aligned_floats(buffer, pairs * in * 32);
  for (int64_t k0 = 0; k0 < in; k0 += 16) {
    const int64_t n = std::min<int64_t>(16, in - k0);
    const __mmask16 columns = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t r0 = 0; r0 < pairs * 32; r0 += 16) {
      __m512 t[16];
      for (int64_t m = 0; m < 16; ++m)
        t[m] = r0 + m < rows ? _mm512_maskz_loadu_ps(columns, x + (r0 + m) * in + k0)
                             : _mm512_setzero_ps();
      transpose16(t);
      float* dst = out + (r0 / 32 * in + k0) * 32 + r0 % 32;
      for (int64_t j = 0; j < n; ++j) _mm512_store_ps(dst + j * 32, t[j]);
    }
  }
  return out;
}
#else
constexpr bool kF32Path = false;
inline void run_rows_f32(const Problem&, int64_t, int64_t, const Argmax&) {}
inline const float* transpose_x(const float*, int64_t, int64_t, std::vector<float>&) {
  return nullptr;
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bfloat16 weights on AMX tiles, past kAmxFromRows rows of x: XLA's dot reaches AMX through
// YNNPACK, which repacks every weight into the tiles' pair layout on every call (a transpose
// of the whole matrix: 42% of a 32-row SmolLM2 decode step's CPU time on a 2-core Xeon, the
// product itself 15%). Here the weight is the tiles' left operand as it lies: 16 of its rows
// x 32 columns, rows row_bytes apart, are a tile as they are; x is the right operand, put
// in pair layout once a call (Linear: x_amx). A result tile sums C[n][m] = w[o + n] .
// x[16 g + m] over the columns, 32 at a time, in the same order at any row count: a
// position's sums do not depend on how many rows its step has (amx_tiles).
constexpr int64_t kAmxFromRows = 8;

// The process may use AMX's tile state (Linux asks for it once: ARCH_REQ_XCOMP_PERM).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 0, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
};

inline bool amx_rows(const Problem& pb) { return pb.x_amx != nullptr; }

// Weight rows [o, o + 16 NB) by x row tiles [g0, g0 + G) (NB, G: 1 or 2): tile 2 b + g sums
// weight block b against x tile g0 + g (tiles 4, 5: the weight blocks; 6, 7: x's), stored to
// c[2 b + g]. Each tile a column step loads goes to two products, and no load waits for a
// product still reading its tile. The first pass over a block (g0 0) prefetches the next
// 16 NB weight rows, one run of 32 NB row_bytes a column step, in address order (a prefetch
// past W's end is dropped: it does not fault), into L2. Into L1 too was slower -- SmolLM2
// bfloat16 at 64 rows, ms a step in one process: 46.8 against 49.0 with async on, 46.9
// against 48.9 off; at 32 rows 30.4 against 30.9 (a guess: x's tiles, 74 KB at 64 rows and
// I 576, and the next block's rows do not fit L1's 48 KB together).
template <int NB, int G>
void amx_tiles(const Problem& pb, int64_t o, int64_t g0, float (*c)[16][16]) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (NB > 1) _tile_zero(2);
  if constexpr (NB > 1 && G > 1) _tile_zero(3);
  const char* w = pb.w + o * pb.row_bytes;
  const int64_t block_bytes = 16 * pb.row_bytes;
  const char* next = g0 == 0 ? w + NB * block_bytes : nullptr;
  const int64_t tile = 16 * 32;  // uint16 of a tile of x
  const uint16_t* x = pb.x_amx + g0 * tile;
  for (int64_t k = 0; k < pb.in; k += 32, x += pb.x_amx_groups * tile) {
    if (next != nullptr) {
      for (int line = 0; line < 16 * NB; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T1);
      next += 1024 * NB;
    }
    _tile_loadd(4, w + 2 * k, pb.row_bytes);
    if constexpr (NB > 1) _tile_loadd(5, w + block_bytes + 2 * k, pb.row_bytes);
    _tile_loadd(6, x, 64);
    if constexpr (G > 1) _tile_loadd(7, x + tile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (G > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NB > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NB > 1 && G > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c[0], 64);
  if constexpr (G > 1) _tile_stored(1, c[1], 64);
  if constexpr (NB > 1) _tile_stored(2, c[2], 64);
  if constexpr (NB > 1 && G > 1) _tile_stored(3, c[3], 64);
}

// Weight rows from o_begin in whole 16s up to o_end on AMX tiles, results (plus the
// residual) to y, or into `best`; returns where it stopped (the rows after it take the other
// paths). The thread's tile configuration is put back after (XLA's own AMX kernels may run
// here).
int64_t run_rows_amx(const Problem& pb, int64_t o_begin, int64_t o_end, const Argmax& best) {
  TileConfig saved, config;
  _tile_storeconfig(&saved);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.bytes[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  alignas(64) float c[4][16][16];
  int64_t o = o_begin;
  while (o + 16 <= o_end) {
    const int nb = o + 32 <= o_end ? 2 : 1;
    for (int64_t g0 = 0; g0 < pb.x_amx_groups; g0 += 2) {
      const bool two = g0 + 1 < pb.x_amx_groups;
      if (nb == 2) two ? amx_tiles<2, 2>(pb, o, g0, c) : amx_tiles<2, 1>(pb, o, g0, c);
      else two ? amx_tiles<1, 2>(pb, o, g0, c) : amx_tiles<1, 1>(pb, o, g0, c);
      // Tile 2 b + g holds [weight row][x row]: transposed, its row m is y's row
      // 16 (g0 + g) + m at columns o + 16 b.
      for (int b = 0; b < nb; ++b)
        for (int g = 0; g < (two ? 2 : 1); ++g) {
          if (best.value) {
            fold16(best, c[2 * b + g][0], 16, 16, o + 16 * b, 16 * (g0 + g));
            continue;
          }
          __m512 v[16];
          for (int n = 0; n < 16; ++n) v[n] = _mm512_load_ps(c[2 * b + g][n]);
          transpose16(v);
          for (int64_t m = 0, r = 16 * (g0 + g); m < 16 && r < pb.rows; ++m, ++r) {
            const int64_t i = r * pb.out + o + 16 * b;
            if (pb.residual) v[m] = _mm512_add_ps(_mm512_loadu_ps(pb.residual + i), v[m]);
            _mm512_storeu_ps(pb.y + i, v[m]);
          }
        }
    }
    o += 16 * nb;
  }
  if (saved.palette != 0) _tile_loadconfig(&saved);
  else _tile_release();
  return o;
}

// x [R, x_bf16_stride] bfloat16 into the tiles' pair layout (Problem::x_amx), zero rows up
// to whole 16s: a tile is 16 of x's rows x 16 column pairs (32-bit units), transposed.
void pack_x_amx(const Problem& pb, std::vector<uint16_t>& out) {
  const int64_t groups = (pb.rows + 15) / 16, blocks = pb.in / 32;
  out.resize(blocks * groups * 16 * 32);
  for (int64_t kb = 0; kb < blocks; ++kb)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 v[16];
      for (int64_t m = 0, r = 16 * g; m < 16; ++m, ++r)
        v[m] = r < pb.rows ? _mm512_loadu_ps(pb.x_bf16 + r * pb.x_bf16_stride + kb * 32)
                           : _mm512_setzero_ps();
      transpose16(v);
      uint16_t* tile = out.data() + (kb * groups + g) * 16 * 32;
      for (int pair = 0; pair < 16; ++pair) _mm512_storeu_ps(tile + pair * 32, v[pair]);
    }
}
#else
constexpr int64_t kAmxFromRows = 8;
inline bool amx_permitted() { return false; }
inline bool amx_rows(const Problem&) { return false; }
inline int64_t run_rows_amx(const Problem&, int64_t o_begin, int64_t, const Argmax&) {
  return o_begin;
}
inline void pack_x_amx(const Problem&, std::vector<uint16_t>&) {}
#endif

// Whether the block takes the direct path of its kind (no dequantized scratch).
inline bool direct(const Problem& pb) {
  switch (pb.kind) {
    case Kind::kBF16: return kDotBF16;
    case Kind::kF32: return false;  // AVX-512: run_rows_f32 takes the whole call
    default: return pb.integer_dots || (kDirectQuant && pb.rows <= kRowTile);  // int8, int4
  }
}

// Results [o, o + block) of every row from the block's sums, plus the residual's; or the
// sums into `best`.
inline void store_block(const Problem& pb, int64_t o, int64_t block, const float* acc,
                        const Argmax& best) {
  if (best.value) {
    for (int64_t r = 0; r < pb.rows; ++r)
      for (int64_t j = 0; j < block; ++j) best.fold(r, o + j, acc[r * kOutBlock + j]);
    return;
  }
  for (int64_t r = 0; r < pb.rows; ++r)
    for (int64_t j = 0; j < block; ++j) {
      const int64_t i = r * pb.out + o + j;
      pb.y[i] = pb.residual ? pb.residual[i] + acc[r * kOutBlock + j] : acc[r * kOutBlock + j];
    }
}

// One work item: weight rows [o_begin, o_end), its sums to y or (LinearArgmax) into `best`.
void run_rows(const Problem& pb, int64_t o_begin, int64_t o_end, const Argmax& best) {
  alignas(64) static thread_local float w[kOutBlock * kChunk];
  static thread_local std::vector<float> acc;
  if (pb.x_t != nullptr) return run_rows_f32(pb, o_begin, o_end, best);
  acc.resize(pb.rows * kOutBlock);
  const int64_t full = pb.rows - pb.rows % kRowTile;
  if (amx_rows(pb)) o_begin = run_rows_amx(pb, o_begin, o_end, best);
  for (int64_t o = o_begin; o < o_end; o += kOutBlock) {
    const int64_t block = std::min<int64_t>(kOutBlock, o_end - o);
    std::fill(acc.begin(), acc.end(), 0.0f);
    if (direct(pb)) {
      if (pb.kind == Kind::kBF16) block_bf16(pb, o, block, acc.data());
      else block_quant(pb, o, block, acc.data());
      store_block(pb, o, block, acc.data(), best);
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
    store_block(pb, o, block, acc.data(), best);
  }
}

// The product's rows as work items, parallel (cpu_pool.h) when the weight's bytes reach
// `parallel_bytes`; for LinearArgmax, each with its own Argmax (pb.argmax).
void run_items(ffi::ThreadPool& pool, const Problem& pb, int64_t parallel_bytes) {
  auto best = [&pb](int64_t i) { return pb.argmax ? pb.argmax->item(i) : Argmax{}; };
  if (pb.weight_bytes < parallel_bytes) {  // the caller alone: no shared state to set up
    if (pb.argmax) pb.argmax->reset(1, pb.rows);
    run_rows(pb, 0, pb.out, best(0));
    return;
  }
  const ksana_cpu_pool::SpinPool& spin_pool = ksana_cpu_pool::SpinPool::get();
  const int64_t workers = spin_pool.enabled() ? spin_pool.workers() : pool.num_threads() + 1;
  // One item a worker, equal whole register blocks: each thread starts one stream of the
  // weight's rows and claims once. The pool's threads spin between the products, so they
  // join within microseconds (and XLA:CPU runs a program's thunks on one thread,
  // cpu_schedule.py, so they keep their core). Guided items (a 2 workers'th of the rows
  // left, down to an 8 workers'th: ~9 a product) evened out a late joiner when XLA's threads
  // took the pool's core (2026-12-03); since the one-thread schedule they were slower:
  // SmolLM2 int4 at batch 1, the engine, 32-token requests alternating in one process
  // (2026-12-05, 2 cores): 206-208 against 216-220 tok/s median in three runs; 16 rows
  // 475 / 469, bfloat16 at 1 row 89 / 89, at 64 rows 602 / 618 (neutral).
  // A float32 product (run_rows_f32) is bound by its multiply-adds, not by its bytes:
  // milliseconds at 64 rows for an LM head, where a thread the scheduler lent to async
  // scheduling's host thread held back the end of its one item. So it takes 8 items a
  // worker, whole 16-row blocks claimed as threads come free, and the threads do not spin
  // after it: spinning beside the host thread took that thread's core (the tiny float32
  // model at 64 rows, async on, 2 cores, ms a step against XLA's in the same process: 6.83 /
  // 6.54 spinning, 6.60 / 6.55 not).
  const bool f32 = pb.x_t != nullptr;
  const int64_t block = f32 ? 16 : kOutBlock, per_worker = f32 ? 8 : 1;
  auto whole = [block](int64_t n) { return (n + block - 1) / block * block; };
  const int64_t rows = whole((pb.out + workers * per_worker - 1) / (workers * per_worker));
  const int64_t n = (pb.out + rows - 1) / rows;
  if (pb.argmax) pb.argmax->reset(n, pb.rows);
  // Spinning for the next call: the kernel serves decode's few rows, where the products
  // follow each other with only small single-threaded thunks between them.
  ksana_cpu_pool::run_on_pool(pool, n, /*spin=*/!f32, [&](int64_t i) {
    run_rows(pb, i * rows, std::min(pb.out, (i + 1) * rows), best(i));
  });
}


bool is_scale_type(ffi::DataType t) { return t == ffi::F32 || t == ffi::F16; }

// One matrix of an operand holding `layers` of them stacked on its leading dim (w, scales
// and mins alike; 1 unstacked): its last two dims ({0, 0} for an empty operand), and its
// bytes from the operand's start at `layer`.
struct Slice {
  int64_t dims[2] = {0, 0};
  const char* data = nullptr;
  int64_t bytes = 0;
};

Slice layer_slice(const ffi::AnyBuffer& a, int64_t layers, int64_t layer) {
  Slice s;
  const auto d = a.dimensions();
  if (a.element_count() == 0) return s;
  s.dims[0] = d[d.size() - 2], s.dims[1] = d[d.size() - 1];
  s.bytes = static_cast<int64_t>(a.size_bytes()) / layers;
  s.data = static_cast<const char*>(a.untyped_data()) + layer * s.bytes;
  return s;
}

// One weight of the call as a Problem (x's fields are set by the caller): checks its shapes.
// A stacked weight (w [L, O, I'], scales and mins [L, O, G]: a layer-stacked parameter that
// the kernel indexes, so a step passes one array for all its layers) gives matrix `layer`.
ffi::Error weight_problem(const ffi::AnyBuffer& w, const ffi::AnyBuffer& scales,
                          const ffi::AnyBuffer& mins, int64_t rows, int64_t in, bool bf16,
                          int64_t layer, Problem& pb) {
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 2 && w_dims.size() != 3)
    return ffi::Error::InvalidArgument("w must be a matrix or a stack of them");
  const int64_t layers = w_dims.size() == 3 ? w_dims[0] : 1;
  if (layer < 0 || layer >= layers) return ffi::Error::InvalidArgument("layer out of range");
  for (const ffi::AnyBuffer* a : {&scales, &mins})
    if (a->element_count() > 0 && (a->dimensions().size() != w_dims.size() ||
                                   (layers > 1 && a->dimensions()[0] != layers)))
      return ffi::Error::InvalidArgument("scales and mins must be stacked as w is");
  const Slice w_at = layer_slice(w, layers, layer), scales_at = layer_slice(scales, layers, layer),
              mins_at = layer_slice(mins, layers, layer);
  pb.rows = rows;
  pb.in = in;
  pb.out = w_dims[w_dims.size() - 2];
  pb.w = w_at.data;
  pb.scales = scales_at.data;
  pb.mins = mins_at.data;
  pb.scales_f16 = scales.element_type() == ffi::F16;
  pb.mins_f16 = mins.element_type() == ffi::F16;
  pb.groups = scales_at.dims[1];
  const bool scaled = scales.element_count() > 0 && scales_at.dims[0] == pb.out &&
                      is_scale_type(scales.element_type());
  switch (w.element_type()) {
    case ffi::F32: pb.kind = Kind::kF32; break;
    case ffi::BF16: pb.kind = Kind::kBF16; break;
    case ffi::S8: pb.kind = Kind::kInt8; break;
    case ffi::U8: pb.kind = Kind::kInt4; break;
    default: return ffi::Error::InvalidArgument("w must be float32, bfloat16, int8 or uint8");
  }
  const int64_t w_in = w_dims[w_dims.size() - 1];
  if (pb.kind == Kind::kInt4) {
    if (w_in * 2 != pb.in || pb.in % 32 || !scaled || pb.groups != pb.in / 32 ||
        mins_at.dims[0] != pb.out || mins_at.dims[1] != pb.groups ||
        !is_scale_type(mins.element_type()))
      return ffi::Error::InvalidArgument(
          "int4: w u8[O, I/2], scales and mins [O, I/32] float32/16, I % 32 == 0");
  } else if (w_in != pb.in) {
    return ffi::Error::InvalidArgument("w's input dim must be x's");
  }
  if (pb.kind == Kind::kInt8 &&
      (!scaled || pb.groups < 1 || pb.in % pb.groups ||
       (pb.groups > 1 && (pb.in / pb.groups) % kLanes)))
    return ffi::Error::InvalidArgument(
        "int8: scales [O, G] float32/16, G = 1 or I / G a multiple of 16");
  pb.bf16 = bf16 || pb.kind == Kind::kBF16;
  pb.weight_bytes = w_at.bytes + scales_at.bytes + mins_at.bytes;
  pb.row_bytes = pb.out ? w_at.bytes / pb.out : 0;
  if (pb.bf16 && pb.kind == Kind::kF32)
    return ffi::Error::InvalidArgument("bf16 is for bfloat16 or quantized weights");
  return ffi::Error::Success();
}

// What a call allocates, kept per thread: its problem, and x as the tiles read it.
struct Scratch {
  Problem problem;
  std::vector<int32_t> vector_group;
  std::vector<float> gated, normed, padded, x_t, x_sum, x_scale, x8_lanes, x_offset;
  std::vector<uint16_t> x_bf16;
  std::vector<uint16_t> x_amx;
  std::vector<int8_t> x8;
};

// x's rows RMS-normed into `normed` as layers.rms_norm does in float32:
// x * rsqrt(mean(x^2) + eps) * (offset + weight), the weight float32 or bfloat16.
const float* rms_norm(const float* x, int64_t rows, int64_t in, const ffi::AnyBuffer& norm,
                      float eps, float offset, std::vector<float>& normed) {
  std::vector<float>& weight = normed;  // first the weight in float32, then the rows after it
  weight.resize(in + rows * in);
  if (norm.element_type() == ffi::BF16) {
    const uint16_t* bits = static_cast<const uint16_t*>(norm.untyped_data());
    for (int64_t k = 0; k < in; ++k) weight[k] = offset + bits_to_f32(uint32_t{bits[k]} << 16);
  } else {
    const float* w = static_cast<const float*>(norm.untyped_data());
    for (int64_t k = 0; k < in; ++k) weight[k] = offset + w[k];
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * in;
    float* dst = normed.data() + in + r * in;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t k = 0; k < in; ++k) squares += src[k] * src[k];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(in) + eps);
    for (int64_t k = 0; k < in; ++k) dst[k] = (src[k] * inv) * weight[k];
  }
  return normed.data() + in;
}

// The gated MLP's activations (Gate in linear_cpu.py), as jax.nn computes them in float32.
enum class Gate : int32_t { kNone = 0, kSilu = 1, kGeluTanh = 2 };

// sigmoid(z) = 1 / (1 + e^-z), through e^-|z| (cpu_simd.h's exp_nonpositive, a loop of it
// vectorizes): no overflow at either end.
inline float sigmoid(float z) {
  const float e = ksana_cpu_simd::exp_nonpositive(-std::abs(z));
  return (z >= 0.0f ? 1.0f : e) / (1.0f + e);
}

// x [R, 2I], each row I (gate, up) pairs as the fused gate/up product gives them, into
// act(gate) * up [R, I] in `gated`: silu(g) = g sigmoid(g), or GELU's tanh approximation
// 0.5 g (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3).
const float* gate_rows(const float* x, int64_t rows, int64_t in, Gate gate,
                       std::vector<float>& gated) {
  gated.resize(rows * in);
  float* out = gated.data();
  const int64_t n = rows * in;
  if (gate == Gate::kSilu) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g = x[2 * i];
      out[i] = g * sigmoid(g) * x[2 * i + 1];
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g = x[2 * i];
      const float u = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
      out[i] = g * sigmoid(2.0f * u) * x[2 * i + 1];
    }
  }
  return out;
}

// The call's Problem in scratch.problem, x prepared as its weight's path reads it, from the
// operands both handlers take (`residual`: null or empty for none); y and the argmax are the
// handler's to set.
ffi::Error prepare(Scratch& scratch, const ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& w,
                   const ffi::AnyBuffer& scales, const ffi::AnyBuffer& mins,
                   const ffi::AnyBuffer& norm, const ffi::Buffer<ffi::F32>* residual, bool bf16,
                   float norm_eps, float norm_offset, int32_t gate, int64_t layer) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("x must be a matrix");
  if (gate < 0 || gate > 2) return ffi::Error::InvalidArgument("gate must be 0, 1 or 2");
  const Gate act = static_cast<Gate>(gate);
  if (act != Gate::kNone && x_dims[1] % 2)
    return ffi::Error::InvalidArgument("a gated x must be [R, 2I]: (gate, up) pairs");
  const int64_t in = act == Gate::kNone ? x_dims[1] : x_dims[1] / 2;
  Problem& pb = scratch.problem;
  pb = Problem{};
  ffi::Error error = weight_problem(w, scales, mins, x_dims[0], in, bf16, layer, pb);
  if (error.failure()) return error;
  const bool normed = norm.element_count() > 0;
  if (normed && (norm.dimensions().size() != 1 || norm.dimensions()[0] != pb.in ||
                 (norm.element_type() != ffi::F32 && norm.element_type() != ffi::BF16)))
    return ffi::Error::InvalidArgument("norm must be [I] float32 / bfloat16, or empty");
  if (residual != nullptr && residual->element_count() > 0) {
    const auto r_dims = residual->dimensions();
    if (r_dims.size() != 2 || r_dims[0] != pb.rows || r_dims[1] != pb.out)
      return ffi::Error::InvalidArgument("residual must be [R, O] or empty");
    pb.residual = residual->typed_data();
  }
  if (pb.kind == Kind::kInt8) {
    std::vector<int32_t>& vector_group = scratch.vector_group;
    vector_group.resize((pb.in + kLanes - 1) / kLanes + 1);
    const int64_t group = pb.in / pb.groups;
    for (size_t v = 0; v < vector_group.size(); ++v)
      vector_group[v] = static_cast<int32_t>(std::min<int64_t>(v * kLanes / group, pb.groups - 1));
    pb.vector_group = vector_group.data();
  }
  if (pb.rows == 0) return ffi::Error::Success();
  const float* x_in = x.typed_data();
  if (act != Gate::kNone) x_in = gate_rows(x_in, pb.rows, pb.in, act, scratch.gated);
  if (normed)
    x_in = rms_norm(x_in, pb.rows, pb.in, norm, norm_eps, norm_offset, scratch.normed);
  pb.integer_dots = integer_dots_fit(pb);
  // x as the tiles read it: a bfloat16 product multiplies x rounded to bfloat16 (XLA's dot
  // rounds it the same way), in bfloat16 for vdpbf16ps; float x is padded with zeros to
  // whole vectors when I is not a multiple of kLanes.
  const bool round_x = pb.bf16;
  if (pb.kind == Kind::kF32 && kF32Path) {
    pb.x_t = transpose_x(x_in, pb.rows, pb.in, scratch.x_t);
  } else if (pb.integer_dots) {
    prepare_x8(x_in, pb, pb.kind == Kind::kInt4, scratch.x8, scratch.x_scale, scratch.x_sum,
               scratch.x8_lanes, scratch.x_offset);
  } else if ((pb.kind == Kind::kBF16 || pb.bf16) && direct(pb)) {
    std::vector<uint16_t>& x_bf16 = scratch.x_bf16;
    pb.x_bf16_stride = (pb.in + 31) / 32 * 32;
    x_bf16.assign(pb.rows * pb.x_bf16_stride, 0);
    for (int64_t r = 0; r < pb.rows; ++r)
      to_bf16(x_in + r * pb.in, pb.in, x_bf16.data() + r * pb.x_bf16_stride);
    pb.x_bf16 = x_bf16.data();
    if (pb.kind == Kind::kBF16 && pb.rows > kAmxFromRows && pb.rows <= 64 && pb.in % 32 == 0 &&
        amx_permitted()) {
      pack_x_amx(pb, scratch.x_amx);
      pb.x_amx = scratch.x_amx.data();
      pb.x_amx_groups = (pb.rows + 15) / 16;
    }
  } else if (pb.in % (2 * kLanes) == 0 && !round_x) {
    pb.x = x_in;
    pb.x_stride = pb.in;
  } else {  // whole steps of 32 columns (the direct int8 path reads x 32 at a time)
    std::vector<float>& padded = scratch.padded;
    pb.x_stride = (pb.in + 2 * kLanes - 1) / (2 * kLanes) * (2 * kLanes);
    padded.assign(pb.rows * pb.x_stride, 0.0f);
    for (int64_t r = 0; r < pb.rows; ++r)
      for (int64_t k = 0; k < pb.in; ++k) {
        const float v = x_in[r * pb.in + k];
        padded[r * pb.x_stride + k] =
            round_x ? bits_to_f32(static_cast<uint32_t>(f32_to_bf16(v)) << 16) : v;
      }
    pb.x = padded.data();
  }
  return ffi::Error::Success();
}

// The call's scratch, kept per thread: a decode step makes ~120 calls of 10-100 us, and
// their allocations (and frees) were ~5% of its samples. The problem lives there too, not
// on this stack: the pool's threads read it while this thread works beside it.
thread_local Scratch call_scratch;

ffi::Error check_y(const Problem& pb, ffi::ResultBuffer<ffi::F32>& y) {
  const auto y_dims = y->dimensions();
  if (y_dims.size() != 2 || y_dims[0] != pb.rows || y_dims[1] != pb.out)
    return ffi::Error::InvalidArgument("y must be [R, O]");
  return ffi::Error::Success();
}

// y f32[R, O] = residual + rms_norm(x) . W^T, the norm (a weight [I]) and the residual
// ([R, O]) each optional (an empty array: none); with a `gate`, x [R, 2I] holds (gate, up)
// pairs and the product's input is act(gate) * up (gate_rows).
ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                  ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::AnyBuffer norm,
                  ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> y, bool bf16,
                  int64_t parallel_bytes, float norm_eps, float norm_offset, int32_t gate,
                  int64_t layer) {
  Problem& pb = call_scratch.problem;
  ffi::Error error = prepare(call_scratch, x, w, scales, mins, norm, &residual, bf16, norm_eps,
                             norm_offset, gate, layer);
  if (error.failure()) return error;
  if (error = check_y(pb, y); error.failure()) return error;
  pb.y = y->typed_data();
  if (pb.rows > 0) run_items(pool, pb, parallel_bytes);
  return ffi::Error::Success();
}

// An LM head and the argmax of its product (greedy decoding) in one call: where `argmax_if`
// holds, ids i32[R] = each row's first largest sum of rms_norm(x) . W^T, folded as the sums
// come (no row of y is written: y is left as it was); otherwise y f32[R, O] is that product,
// as Linear's (ids zero). The sums are Linear's, so its ids are y's first maxima.
ffi::Error LinearArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                        ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::AnyBuffer norm,
                        ffi::Buffer<ffi::PRED> argmax_if, ffi::ResultBuffer<ffi::F32> y,
                        ffi::ResultBuffer<ffi::S32> ids, bool bf16, int64_t parallel_bytes,
                        float norm_eps, float norm_offset, int64_t layer) {
  static thread_local ArgmaxItems items;
  Problem& pb = call_scratch.problem;
  ffi::Error error = prepare(call_scratch, x, w, scales, mins, norm, nullptr, bf16, norm_eps,
                             norm_offset, 0, layer);
  if (error.failure()) return error;
  if (error = check_y(pb, y); error.failure()) return error;
  if (argmax_if.element_count() != 1 || ids->element_count() != pb.rows)
    return ffi::Error::InvalidArgument("argmax_if must be one bool and ids [R]");
  pb.y = y->typed_data();
  std::fill_n(ids->typed_data(), pb.rows, 0);
  if (pb.rows == 0) return ffi::Error::Success();
  const bool argmax = *argmax_if.typed_data();
  if (argmax) pb.argmax = &items;
  run_items(pool, pb, parallel_bytes);
  if (argmax) items.first_max(pb.rows, ids->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KsanaLinearCpu, Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [R, I]
                                  // w [O, I] (int4: u8[O, I/2]), or [L, O, I] stacked
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()  // scales [(L,) O, G] or [0, 0]
                                  .Arg<ffi::AnyBuffer>()  // mins [(L,) O, I/32] or [0, 0]
                                  .Arg<ffi::AnyBuffer>()  // norm [I] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual [R, O] or [0, 0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [R, O]
                                  .Attr<bool>("bf16")  // bfloat16 products (see Problem)
                                  // weight bytes from which the pool's threads join
                                  .Attr<int64_t>("parallel_bytes")
                                  .Attr<float>("norm_eps")
                                  .Attr<float>("norm_offset")
                                  .Attr<int32_t>("gate")  // Gate: 0 none, 1 silu, 2 GELU
                                  .Attr<int64_t>("layer"));  // a stacked w's matrix

XLA_FFI_DEFINE_HANDLER_SYMBOL(KsanaLinearArgmaxCpu, LinearArgmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [R, I]
                                  .Arg<ffi::AnyBuffer>()  // w, as Linear's
                                  .Arg<ffi::AnyBuffer>()  // scales, as Linear's
                                  .Arg<ffi::AnyBuffer>()  // mins, as Linear's
                                  .Arg<ffi::AnyBuffer>()  // norm [I] or [0]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // argmax_if []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [R, O]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // ids [R]
                                  .Attr<bool>("bf16")
                                  .Attr<int64_t>("parallel_bytes")
                                  .Attr<float>("norm_eps")
                                  .Attr<float>("norm_offset")
                                  .Attr<int64_t>("layer"));
