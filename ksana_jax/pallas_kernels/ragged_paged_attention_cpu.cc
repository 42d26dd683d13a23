// Ragged paged attention for CPUs, an XLA FFI custom call: reference.py's semantics.
//
// Built at first use by ragged_paged_attention_cpu.py (g++ -O3 -march=native). XLA:CPU
// cannot express this well in jnp: a paged gather is an element loop, float16 converts one
// element at a time, and a batched [3 x 64] x [64 x C] product per (sequence, KV head) is a
// library call each.
//
// Work items: one row, one KV head, up to kQueryBlock of the row's new tokens (times the
// query heads of that KV head), spread over XLA's intra-op thread pool, longest contexts
// first. An item streams its row's positions once, kTile at a time:
//   phase 1  the tile's keys and values, converted to float32 (an L1-sized tile);
//   phase 2  scores: one dot product per (query, key) for decode items, or, from
//            kTransposeFrom queries on (prefill), the tile's keys transposed and scored
//            kScoreBlock queries at a time;
//   phase 3  optional soft-cap (cap * tanh(s / cap)), then online softmax in float32
//            (running max, denominator, weighted value sum per query), rescaled tile by
//            tile as in flash attention; kPvRows queries at a time add up the tile's
//            values with their sums held in registers (each value row loaded once for
//            the block; a position a query does not see weighs 0).
//
// Position p of row s comes from the pages (through the page table) when p < num_cached,
// and from k_new / v_new when it is one of the step's own tokens; a query at position q
// sees positions up to its own, and with a sliding window W only those > q - W. An item
// streams positions from the window start of its earliest query (0 without a window) to
// its latest query: nothing outside that range is ever read (pages wholly before the
// window are skipped, not masked), so NaN there is harmless. Every row's page ids (from its
// first window page on), cached length and query offsets are checked before anything is
// read.
//
// Quantized pages (int8, float8_e4m3fn) carry a float32 scale per row beside them
// (`scales` [L, 2, K, num_pages, page_size]); phase 1 dequantizes value * scale while
// converting the tile to float32. The step's own k_new / v_new come as float32 then (the
// model hands attention those rows already quantized and dequantized). Float pages ignore
// `scales` (a placeholder) and take k_new / v_new in their own dtype.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_pool.h"
#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTile = 16;        // key positions per tile (one AVX-512 register of floats)
constexpr int kQueryBlock = 16;  // new tokens of a row per work item
constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;    // query heads per KV head
// Steps with less work than this (positions read times the queries that read them) run on
// the caller's thread alone, as linear_cpu.cc's small products: a batch-1 decode layer's
// attention is a few microseconds of work, and handing items to XLA's pool cost ~50 us a
// call on this repo's loaded 2-core machine (SmolLM2 bfloat16 decode: 30 calls a step).
constexpr int64_t kParallelWork = 16384;

// 16-bit floats to float32. bfloat16 is float32's top half; float16 goes through F16C when
// the build machine has it, else a bit-exact scalar conversion.
inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);  // inf / NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: renormalize
    int shift = 0;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float8_e4m3fn to float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal (m / 8 * 2^-6); S.1111.111 is NaN; no infinities.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 0xf, mantissa = b & 7;
      float v = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)
                              : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 0xf && mantissa == 7) v = NAN;
      value[b] = (b & 0x80) ? -v : v;
    }
  }
};
const Fp8Table kFp8;

enum class Kind { kF32, kBF16, kF16, kI8, kF8E4M3 };

// Row of n values at src as float32, times `scale` for the quantized kinds.
inline void load_row(Kind kind, const void* src, float* dst, int n, float scale = 1.0f) {
  switch (kind) {
    case Kind::kI8: {
      const int8_t* s = static_cast<const int8_t*>(src);
#pragma omp simd
      for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]) * scale;
      return;
    }
    case Kind::kF8E4M3: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      for (int i = 0; i < n; ++i) dst[i] = kFp8.value[s[i]] * scale;
      return;
    }
    case Kind::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case Kind::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      int i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(
                                      _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
      }
#endif
      for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case Kind::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      int i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(half));
      }
#endif
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(half));
      }
#endif
      for (; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
  }
}

using ksana_cpu_simd::exp_nonpositive;

#if defined(__AVX512F__)
// exp_nonpositive of 16 lanes: the same steps, one lane each.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shifter), shifter);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// A decode query's scores against a tile's keys [width, kHeadDim] (float32, stride
// kHeadDim): a vector of partial products per key, the 16 reduced at once (lane_sums16) --
// a reduction per key, as a dot product each took, was most of a decode item's time.
// Lanes past `width` are 0.
template <int kHeadDim>
inline __m512 tile_scores(const float* q, const float* keys, int width) {
  constexpr int kVecs = kHeadDim / 16;
  __m512 qv[kVecs], part[kTile];
#pragma GCC unroll 16
  for (int v = 0; v < kVecs; ++v) qv[v] = _mm512_loadu_ps(q + 16 * v);
#pragma GCC unroll 16
  for (int j = 0; j < kTile; ++j) {
    part[j] = _mm512_setzero_ps();
    if (j >= width) continue;
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v)
      part[j] = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(keys + j * kHeadDim + 16 * v), part[j]);
  }
  return ksana_cpu_simd::lane_sums16(part[0], part[1], part[2], part[3], part[4], part[5],
                                     part[6], part[7], part[8], part[9], part[10], part[11],
                                     part[12], part[13], part[14], part[15]);
}
#endif

struct Problem {
  Kind kind, new_kind;          // of the pages; of k_new / v_new
  size_t itemsize, new_itemsize;
  const float* q;               // [T, N, H]
  const char* k_new;            // [T, K, H]
  const char* v_new;            // [T, K, H]
  const char* kv;               // [L, 2, K, num_pages, page_size, H]
  const float* scales;          // [L, 2, K, num_pages, page_size] (quantized), else null
  int64_t layer;
  const int32_t* page_table;    // [S, P], or with page_rows [R, P]
  const int32_t* page_rows;     // [S]: sequence s's pages are row page_rows[s]; null: row s
  const int32_t* seq_lens;      // [S]
  const int32_t* query_starts;  // [S + 1]
  float* out;                   // [T, N, H]
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, num_pages, page_size, pages_per_seq;
  int64_t table_rows;  // of page_table
  float sm_scale;
  int32_t sliding_window;  // W, or 0 for none
  float logit_softcap;     // c, or 0 for none
};

// Sequence s's page ids (pages_per_seq of them).
inline const int32_t* page_row(const Problem& pb, int64_t s) {
  return pb.page_table + (pb.page_rows ? pb.page_rows[s] : s) * pb.pages_per_seq;
}

struct Item {
  int32_t row, kv_head, first, count;  // new tokens first .. first + count - 1 of the row
  int32_t lo;                          // the earliest position it reads (window start)
  int32_t last;                        // the latest position it reads
};

constexpr int kMaxQueries = kQueryBlock * kMaxGroup;
constexpr int kScoreBlock = 4;      // queries scored together against a transposed tile
constexpr int kTransposeFrom = 8;   // queries in an item from which the tile is transposed
constexpr int kPvRows = kScoreBlock;  // queries whose value sums are updated together

// acc[r] = acc[r] * rescale[r] + sum_j p[r][j] * values[j] over j in [lo, hi), for the first
// `rows` of kRows rows of acc (stride H). With kHeadDim a multiple of 16 on AVX-512, the
// kRows x kHeadDim accumulators stay in registers and each value row is loaded once for all
// rows; the sums run in the same order as the scalar loop (per element: rescale, then j
// ascending, one FMA each).
template <int kHeadDim, int kRows>
inline void accumulate(float* acc, int rows, int64_t H, const float* values,
                       const float (*p)[kTile], const float* rescale, int lo, int hi) {
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0 && kRows * kHeadDim / 16 <= 16) {
    constexpr int kVecs = kHeadDim / 16;
    __m512 a[kRows][kVecs];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512 scale = _mm512_set1_ps(rescale[r]);
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v)
        a[r][v] = r < rows ? _mm512_mul_ps(_mm512_loadu_ps(acc + r * kHeadDim + 16 * v), scale)
                           : _mm512_setzero_ps();
    }
    for (int j = lo; j < hi; ++j) {
      const float* vj = values + j * kHeadDim;
      __m512 vv[kVecs];
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) vv[v] = _mm512_loadu_ps(vj + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const __m512 pj = _mm512_set1_ps(p[r][j]);
#pragma GCC unroll 8
        for (int v = 0; v < kVecs; ++v) a[r][v] = _mm512_fmadd_ps(pj, vv[v], a[r][v]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) break;
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(acc + r * kHeadDim + 16 * v, a[r][v]);
    }
    return;
  }
#endif
  for (int r = 0; r < rows; ++r) {
    float* a = acc + r * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) a[h] *= rescale[r];
    for (int j = lo; j < hi; ++j) {
      const float pj = p[r][j];
      const float* vj = values + j * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) a[h] += pj * vj[h];
    }
  }
}

// Attention of `item`'s queries (count tokens x group heads) over their row's positions.
// kHeadDim > 0 fixes the head dim at compile time (the inner loops unroll into registers);
// 0 reads it from the problem.
template <int kHeadDim>
void attend(const Problem& pb, const Item& item) {
  const int64_t H = kHeadDim > 0 ? kHeadDim : pb.head_dim;
  const int64_t K = pb.num_kv_heads, N = pb.num_heads;
  const int group = static_cast<int>(N / K);
  const int num_queries = item.count * group;
  const int32_t start = pb.query_starts[item.row];
  const int32_t num_new = pb.query_starts[item.row + 1] - start;
  const int32_t num_cached = pb.seq_lens[item.row] - num_new;
  const int32_t* table = page_row(pb, item.row);
  // Element offsets of this layer's keys and values for this KV head.
  const int64_t page_elems = pb.page_size * H;
  const int64_t head_elems = pb.num_pages * page_elems;
  const int64_t keys_base = ((pb.layer * 2 + 0) * K + item.kv_head) * head_elems;
  const int64_t values_base = ((pb.layer * 2 + 1) * K + item.kv_head) * head_elems;

  // Rows packed at stride H (a power-of-two stride of 1 KB would pile every row into the
  // same few L1 sets); the values kLanePad floats past the keys' end, so that a value row is
  // not 4 KiB (H = 64) from its key row (a store and a later load 4 KiB apart stall).
  constexpr int64_t kLanePad = 16;
  thread_local std::vector<float> scratch;
  scratch.resize((2 * kMaxQueries + 3 * kTile) * H + 2 * kLanePad);
  float* queries = scratch.data();                     // [num_queries, H], pre-scaled
  float* acc = queries + kMaxQueries * H;              // [num_queries, H]
  float* keys = acc + kMaxQueries * H;                 // [kTile, H]
  float* values = keys + kTile * H + kLanePad;         // [kTile, H]
  float* keys_t = values + kTile * H + kLanePad;       // [H, kTile]
  // The tile's keys and values as phase 2 and 3 read them: in a float32 page itself where
  // the tile is one run of it (no copy), else in the scratch above.
  const float* tile_keys = keys;
  const float* tile_values = values;
  float running_max[kMaxQueries], denominator[kMaxQueries];
  int32_t query_pos[kMaxQueries], query_lo[kMaxQueries];  // sees positions lo .. pos

  for (int i = 0; i < num_queries; ++i) {
    const int64_t token = start + item.first + i / group;
    const int64_t head = item.kv_head * group + i % group;
    const float* src = pb.q + (token * N + head) * H;
    for (int64_t h = 0; h < H; ++h) queries[i * H + h] = src[h] * pb.sm_scale;
    std::fill(acc + i * H, acc + (i + 1) * H, 0.0f);
    running_max[i] = -INFINITY;
    denominator[i] = 0.0f;
    query_pos[i] = num_cached + item.first + i / group;
    query_lo[i] = pb.sliding_window > 0 ? std::max(0, query_pos[i] - pb.sliding_window + 1) : 0;
  }
  const int32_t last = item.last;

  // Positions [pos, pos + n) -- cached ones in one page, or new ones -- of the keys
  // (which 0) or values (1) into dst [n, H] as float32. A page's rows are adjacent: one
  // conversion for a float page's run.
  auto load_positions = [&](int32_t pos, int n, int which, float* dst) {
    if (pos < num_cached) {
      const int64_t page = table[pos / pb.page_size];
      const int64_t row = (which ? values_base : keys_base) / H + page * pb.page_size +
                          pos % pb.page_size;  // the row's index among [L, 2, K, pages, ps]
      const char* src = pb.kv + row * H * pb.itemsize;
      if (pb.scales == nullptr) return load_row(pb.kind, src, dst, static_cast<int>(n * H));
      for (int j = 0; j < n; ++j)
        load_row(pb.kind, src + j * H * pb.itemsize, dst + j * H, H, pb.scales[row + j]);
      return;
    }
    const int64_t token = start + (pos - num_cached);
    const char* base = which ? pb.v_new : pb.k_new;
    for (int j = 0; j < n; ++j)
      load_row(pb.new_kind, base + (((token + j) * K + item.kv_head) * H) * pb.new_itemsize,
               dst + j * H, H);
  };

  // Where positions [pos, pos + n) of the keys (which 0) or values (1) lie in a float32
  // page without scales, all in one page: their rows there (stride H), else null.
  auto in_page = [&](int32_t pos, int n, int which) -> const float* {
    if (pb.kind != Kind::kF32 || pb.scales != nullptr || pos + n > num_cached) return nullptr;
    if (pos / pb.page_size != (pos + n - 1) / pb.page_size) return nullptr;
    const int64_t page = table[pos / pb.page_size];
    const int64_t base = which ? values_base : keys_base;
    const int64_t row = page * pb.page_size + pos % pb.page_size;
    return reinterpret_cast<const float*>(pb.kv) + base + row * H;
  };

  // Positions of the tile that query i sees: [from, to), empty when from >= to.
  auto seen = [&](int i, int32_t tile_start, int width, int* from, int* to) {
    *from = std::max(0, query_lo[i] - tile_start);
    *to = std::min(width, query_pos[i] - tile_start + 1);
    return *from < *to;
  };
  // Phase 3 for queries first .. first + rows - 1 (rows <= kPvRows) with their scaled scores
  // p[r][0, width): soft-cap, online softmax, then the weighted sum of the tile's values,
  // every query's accumulator held in registers while the tile's values stream past once
  // for the whole block. A position a query does not see weighs exactly 0.
  const float cap = pb.logit_softcap;
  auto absorb_block = [&](int first, int rows, float (*p)[kTile], int32_t tile_start,
                          int width) {
    float rescale[kPvRows];
    int lo_j = width, hi_j = 0;
    for (int r = 0; r < kPvRows; ++r) {
      const int i = first + r;
      int from = 0, to = 0;
      if (r >= rows || !seen(i, tile_start, width, &from, &to)) {
        std::fill(p[r], p[r] + kTile, 0.0f);
        rescale[r] = 1.0f;
        continue;
      }
      lo_j = std::min(lo_j, from);
      hi_j = std::max(hi_j, to);
      float* pr = p[r];
#if defined(__AVX512F__)
      if (cap == 0.0f) {  // the loops below, 16 lanes at a time (p is 64-byte aligned)
        const __mmask16 lanes = static_cast<__mmask16>(((1u << to) - 1) & ~((1u << from) - 1));
        const __m512 scores = _mm512_load_ps(pr);
        const float new_max = std::max(running_max[i], _mm512_mask_reduce_max_ps(lanes, scores));
        rescale[r] = exp_nonpositive(running_max[i] - new_max);
        const __m512 weights = _mm512_maskz_mov_ps(
            lanes, exp_nonpositive16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
        _mm512_store_ps(pr, weights);
        denominator[i] = denominator[i] * rescale[r] + _mm512_reduce_add_ps(weights);
        running_max[i] = new_max;
        continue;
      }
#endif
      if (cap > 0.0f) {
        for (int j = from; j < to; ++j) pr[j] = cap * std::tanh(pr[j] / cap);
      }
      float new_max = running_max[i];
      for (int j = from; j < to; ++j) new_max = std::max(new_max, pr[j]);
      rescale[r] = exp_nonpositive(running_max[i] - new_max);  // ~0 at the first tile
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int j = from; j < to; ++j) {
        pr[j] = exp_nonpositive(pr[j] - new_max);
        sum += pr[j];
      }
      for (int j = 0; j < from; ++j) pr[j] = 0.0f;
      for (int j = to; j < kTile; ++j) pr[j] = 0.0f;
      denominator[i] = denominator[i] * rescale[r] + sum;
      running_max[i] = new_max;
    }
    if (lo_j >= hi_j) return;  // no query of the block sees this tile
    float* block_acc = acc + static_cast<int64_t>(first) * H;
    switch (rows) {  // a register tile of the block's own rows (a GQA group of 3: no 4th)
      case 1: return accumulate<kHeadDim, 1>(block_acc, 1, H, tile_values, p, rescale, lo_j, hi_j);
      case 2: return accumulate<kHeadDim, 2>(block_acc, 2, H, tile_values, p, rescale, lo_j, hi_j);
      case 3: return accumulate<kHeadDim, 3>(block_acc, 3, H, tile_values, p, rescale, lo_j, hi_j);
      default:
        return accumulate<kHeadDim, kPvRows>(block_acc, rows, H, tile_values, p, rescale, lo_j,
                                             hi_j);
    }
  };

  // Prefill items (many queries) score a tile as a small matrix product against the tile's
  // keys transposed, kScoreBlock queries at a time, so each key value loaded feeds
  // kScoreBlock FMAs; decode items (a few queries) take one dot product per key, which
  // skips the transpose.
  const bool transposed = num_queries >= kTransposeFrom;
  for (int32_t tile_start = item.lo; tile_start <= last; tile_start += kTile) {
    const int width = std::min<int32_t>(kTile, last + 1 - tile_start);
    // Phase 1: this tile's keys and values, in float32: read where they are when the tile
    // is one run of a float32 page, else copied (converted) into the scratch.
    tile_keys = in_page(tile_start, width, 0);
    tile_values = in_page(tile_start, width, 1);
    if (tile_keys == nullptr) tile_keys = keys, tile_values = values;
    for (int j = 0; j < width && tile_keys == keys;) {  // runs of a page (or of new tokens)
      const int32_t pos = tile_start + j;
      const int n = pos < num_cached
                        ? std::min({width - j, num_cached - pos,
                                    static_cast<int>(pb.page_size - pos % pb.page_size)})
                        : width - j;
      load_positions(pos, n, 0, keys + j * H);
      load_positions(pos, n, 1, values + j * H);
      j += n;
    }
    // Phase 2: scores, kPvRows queries at a time, then phase 3: absorb them.
    if (transposed) {
      for (int j = 0; j < kTile; ++j) {
        for (int64_t h = 0; h < H; ++h)
          keys_t[h * kTile + j] = j < width ? tile_keys[j * H + h] : 0.0f;
      }
    }
    for (int block = 0; block < num_queries; block += kPvRows) {
      const int rows = std::min(kPvRows, num_queries - block);
      alignas(64) float scores[kPvRows][kTile] = {};
      if (transposed) {
        for (int64_t h = 0; h < H; ++h) {
          const float* kt = keys_t + h * kTile;
          for (int r = 0; r < rows; ++r) {
            const float qh = queries[(block + r) * H + h];
#pragma omp simd
            for (int j = 0; j < kTile; ++j) scores[r][j] += qh * kt[j];
          }
        }
      } else {
        for (int r = 0; r < rows; ++r) {
          int from, to;
          if (!seen(block + r, tile_start, width, &from, &to)) continue;
          const float* qi = queries + (block + r) * H;
#if defined(__AVX512F__)
          if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {  // every key; absorb masks
            _mm512_store_ps(scores[r], tile_scores<kHeadDim>(qi, tile_keys, width));
            continue;
          }
#endif
          for (int j = from; j < to; ++j) {
            const float* kj = tile_keys + j * H;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t h = 0; h < H; ++h) dot += qi[h] * kj[h];
            scores[r][j] = dot;
          }
        }
      }
      absorb_block(block, rows, scores, tile_start, width);
    }
  }
  for (int i = 0; i < num_queries; ++i) {
    const int64_t token = start + item.first + i / group;
    const int64_t head = item.kv_head * group + i % group;
    float* dst = pb.out + (token * N + head) * H;
    const float inv = 1.0f / denominator[i];  // every query sees at least its own key
    for (int64_t h = 0; h < H; ++h) dst[h] = acc[i * H + h] * inv;
  }
}

void attend_any(const Problem& pb, const Item& item) {
  switch (pb.head_dim) {
    case 32: return attend<32>(pb, item);
    case 64: return attend<64>(pb, item);
    case 128: return attend<128>(pb, item);
    default: return attend<0>(pb, item);
  }
}

// Items a thread other than the call's ran (KsanaAttentionItemsShared: tests read it).
std::atomic<int64_t> items_shared{0};

// Runs every item on the caller and the pool's threads (cpu_pool.h), or on the caller alone
// for a small step. The kernels' pool is awake when a product just before asked it to spin
// (linear_cpu.cc at decode's few rows): then products follow this call too, so even a small
// step's items go to it (no wake to pay; it would spin idle otherwise) and it keeps
// spinning after (if another call holds it, a small step runs on the caller: XLA's pool
// would cost a wake). Asleep, a small step stays on the caller and a large one leaves the
// pool asleep after it: XLA's multithreaded dots come next at the rows that make it large.
void run_items(ffi::ThreadPool& pool, const Problem& pb, const std::vector<Item>& items) {
  const int64_t group = pb.num_heads / pb.num_kv_heads;
  int64_t amount = 0;
  for (const Item& item : items) amount += int64_t{item.last - item.lo + 1} * item.count * group;
  const int64_t count = static_cast<int64_t>(items.size());
  const std::thread::id caller = std::this_thread::get_id();
  auto run = [&](int64_t i) {
    attend_any(pb, items[i]);
    if (std::this_thread::get_id() != caller) items_shared.fetch_add(1, std::memory_order_relaxed);
  };
  ksana_cpu_pool::SpinPool& spin_pool = ksana_cpu_pool::SpinPool::get();
  const bool awake = spin_pool.awake();
  if (amount < kParallelWork || count == 1) {  // the awake pool or the caller, never XLA's
    auto call = [](void* ctx, int64_t i) { (*static_cast<decltype(run)*>(ctx))(i); };
    if (count == 1 || !awake || !spin_pool.try_run(count, call, &run, /*spin=*/true))
      for (int64_t i = 0; i < count; ++i) run(i);
    return;
  }
  ksana_cpu_pool::run_on_pool(pool, count, /*spin=*/awake, run);
}

// The pages' kind and item size into pb.
ffi::Error page_kind(const ffi::AnyBuffer& kv, Problem& pb) {
  switch (kv.element_type()) {
    case ffi::F32: pb.kind = Kind::kF32; pb.itemsize = 4; break;
    case ffi::BF16: pb.kind = Kind::kBF16; pb.itemsize = 2; break;
    case ffi::F16: pb.kind = Kind::kF16; pb.itemsize = 2; break;
    case ffi::S8: pb.kind = Kind::kI8; pb.itemsize = 1; break;
    case ffi::F8E4M3FN: pb.kind = Kind::kF8E4M3; pb.itemsize = 1; break;
    default:
      return ffi::Error::InvalidArgument(
          "kv must be float32, bfloat16, float16, int8 or float8_e4m3fn");
  }
  return ffi::Error::Success();
}

// The step's shapes (q's or out's dims: [T, N, H]) and arrays into pb (q, k_new, v_new and
// the pages' data are the caller's), checked. `page_rows` [S] or empty: which row of
// page_table [R, P] holds each sequence's pages (the persistent batch's table read in place:
// no [S, P] gather of it a step); empty, row s.
ffi::Error set_problem(ffi::Span<const int64_t> q_dims, const ffi::AnyBuffer& kv,
                       const ffi::Buffer<ffi::S32>& layer_index,
                       const ffi::Buffer<ffi::S32>& page_table,
                       const ffi::Buffer<ffi::S32>& page_rows,
                       const ffi::Buffer<ffi::S32>& seq_lens,
                       const ffi::Buffer<ffi::S32>& query_starts, float* out, float sm_scale,
                       int32_t sliding_window, float logit_softcap, Problem& pb) {
  const auto kv_dims = kv.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 6 || kv_dims[1] != 2 || kv_dims[5] != q_dims[2])
    return ffi::Error::InvalidArgument("q must be [T, N, H] and kv [L, 2, K, pages, page, H]");
  pb.num_tokens = q_dims[0];
  pb.num_heads = q_dims[1];
  pb.head_dim = q_dims[2];
  pb.num_kv_heads = kv_dims[2];
  pb.num_pages = kv_dims[3];
  pb.page_size = kv_dims[4];
  if (pb.head_dim > kMaxHeadDim || pb.num_heads / pb.num_kv_heads > kMaxGroup)
    return ffi::Error::InvalidArgument("head_dim must be <= 256 and query heads per KV head <= 16");
  pb.layer = layer_index.typed_data()[0];
  if (pb.layer < 0 || pb.layer >= kv_dims[0])
    return ffi::Error::InvalidArgument("layer_index out of range");
  const int64_t num_seqs = seq_lens.dimensions()[0];
  pb.page_rows = page_rows.element_count() > 0 ? page_rows.typed_data() : nullptr;
  if (page_table.dimensions().size() != 2 ||
      (pb.page_rows ? page_rows.element_count() != num_seqs
                    : page_table.dimensions()[0] < num_seqs))
    return ffi::Error::InvalidArgument("page_table must be [S, P], or [R, P] with page_rows [S]");
  pb.page_table = page_table.typed_data();
  pb.table_rows = page_table.dimensions()[0];
  pb.pages_per_seq = page_table.dimensions()[1];
  pb.seq_lens = seq_lens.typed_data();
  pb.query_starts = query_starts.typed_data();
  pb.out = out;
  pb.sm_scale = sm_scale;
  pb.sliding_window = sliding_window;
  pb.logit_softcap = logit_softcap;
  if (sliding_window < 0 || logit_softcap < 0.0f)
    return ffi::Error::InvalidArgument("sliding_window and logit_softcap must be >= 0");
  return ffi::Error::Success();
}

// Lists the step's items, checking every row before anything is read (a bad step is an
// error, never a stray read), and runs them.
ffi::Error attend_rows(ffi::ThreadPool& pool, const Problem& pb, int64_t num_seqs) {
  std::memset(pb.out, 0, sizeof(float) * pb.num_tokens * pb.num_heads * pb.head_dim);
  const int32_t sliding_window = pb.sliding_window;
  std::vector<Item> items;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int64_t start = pb.query_starts[s], num_new = pb.query_starts[s + 1] - start;
    const int64_t num_cached = pb.seq_lens[s] - num_new;
    if (start < 0 || num_new < 0 || start + num_new > pb.num_tokens)
      return ffi::Error::InvalidArgument("query_starts must be non-decreasing within [0, T]");
    if (num_new == 0) continue;  // a padding row: nothing is read
    if (num_cached < 0 || num_cached > pb.pages_per_seq * pb.page_size)
      return ffi::Error::InvalidArgument("seq_lens: a row's cached tokens exceed its page table");
    // The earliest position any of the row's queries sees: its first new token's window.
    const int64_t row_lo =
        sliding_window > 0 ? std::max<int64_t>(0, num_cached - sliding_window + 1) : 0;
    if (pb.page_rows && (pb.page_rows[s] < 0 || pb.page_rows[s] >= pb.table_rows))
      return ffi::Error::InvalidArgument("page_rows: a row is out of the table");
    const int32_t* table = page_row(pb, s);
    for (int64_t i = row_lo / pb.page_size; i * pb.page_size < num_cached; ++i) {
      if (table[i] < 0 || table[i] >= pb.num_pages)
        return ffi::Error::InvalidArgument("page_table: a page id is out of range");
    }
    for (int32_t first = 0; first < num_new; first += kQueryBlock) {
      const int32_t count = std::min<int32_t>(kQueryBlock, num_new - first);
      const int32_t first_pos = static_cast<int32_t>(num_cached) + first;
      const int32_t lo = sliding_window > 0 ? std::max(0, first_pos - sliding_window + 1) : 0;
      const int32_t last = first_pos + count - 1;
      for (int32_t k = 0; k < pb.num_kv_heads; ++k)
        items.push_back({s, k, first, count, lo, last});
    }
  }
  // Longest spans first, so the last items to finish are short ones.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.last - a.lo > b.last - b.lo; });
  if (!items.empty()) run_items(pool, pb, items);
  return ffi::Error::Success();
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_new,
                     ffi::AnyBuffer v_new, ffi::AnyBuffer kv, ffi::Buffer<ffi::F32> scales,
                     ffi::Buffer<ffi::S32> layer_index, ffi::Buffer<ffi::S32> page_table,
                     ffi::Buffer<ffi::S32> page_rows, ffi::Buffer<ffi::S32> seq_lens,
                     ffi::Buffer<ffi::S32> query_starts,
                     ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                     int32_t sliding_window, float logit_softcap) {
  Problem pb;
  ffi::Error error = page_kind(kv, pb);
  if (error.failure()) return error;
  const bool quantized = pb.kind == Kind::kI8 || pb.kind == Kind::kF8E4M3;
  const auto new_type = quantized ? ffi::F32 : kv.element_type();
  if (k_new.element_type() != new_type || v_new.element_type() != new_type)
    return ffi::Error::InvalidArgument(
        "k_new and v_new must have a float kv's dtype, float32 for a quantized kv");
  pb.new_kind = quantized ? Kind::kF32 : pb.kind;
  pb.new_itemsize = quantized ? 4 : pb.itemsize;
  pb.scales = nullptr;
  if (quantized) {
    const auto scale_dims = scales.dimensions();
    const auto dims = kv.dimensions();
    if (scale_dims.size() != 5 || scale_dims[0] != dims[0] || scale_dims[1] != 2 ||
        scale_dims[2] != dims[2] || scale_dims[3] != dims[3] || scale_dims[4] != dims[4])
      return ffi::Error::InvalidArgument("scales must be [L, 2, K, num_pages, page_size]");
    pb.scales = scales.typed_data();
  }
  error = set_problem(q.dimensions(), kv, layer_index, page_table, page_rows, seq_lens,
                      query_starts, out->typed_data(), sm_scale, sliding_window, logit_softcap,
                      pb);
  if (error.failure()) return error;
  pb.q = q.typed_data();
  pb.k_new = static_cast<const char*>(k_new.untyped_data());
  pb.v_new = static_cast<const char*>(v_new.untyped_data());
  pb.kv = static_cast<const char*>(kv.untyped_data());
  return attend_rows(pool, pb, seq_lens.dimensions()[0]);
}

// One layer's new rows k_new / v_new [T, K, H] (`row_bytes` each, in the pages' dtype) into
// their slots of the pages [L, 2, K, num_pages, page_size, H] at `dst`. A slot outside the
// pages is skipped, as XLA's scatter drops it.
void write_rows(char* dst, const ffi::AnyBuffer& pages, int64_t layer, const char* k_new,
                const char* v_new, const int32_t* slot, int64_t num_tokens, int64_t row_bytes) {
  const auto dims = pages.dimensions();
  const int64_t num_kv_heads = dims[2], slots = dims[3] * dims[4];
  const char* news[2] = {k_new, v_new};
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0 || slot[t] >= slots) continue;
    for (int64_t which = 0; which < 2; ++which)
      for (int64_t k = 0; k < num_kv_heads; ++k) {
        const int64_t row = ((layer * 2 + which) * num_kv_heads + k) * slots + slot[t];
        std::memcpy(dst + row * row_bytes, news[which] + (t * num_kv_heads + k) * row_bytes,
                    row_bytes);
      }
  }
}

// The result buffer aliased to the pages (XLA could not alias: a copy of them first).
char* pages_in_place(const ffi::AnyBuffer& pages, ffi::Result<ffi::AnyBuffer>& out) {
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pages.untyped_data()) std::memcpy(dst, pages.untyped_data(), pages.size_bytes());
  return dst;
}

// One layer's new keys and values k_new / v_new [T, K, H] (in the pages' float dtype) into
// their slots of pages [L, 2, K, num_pages, page_size, H], in place: the result is the
// pages' own buffer (the Python side aliases it to the operand). reference.write_layer_kv's
// semantics, without XLA:CPU's scatter and the padding of a one-row write it needs (four
// thunks a layer at batch 1).
ffi::Error WriteLayerKV(ffi::AnyBuffer pages, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                        ffi::Buffer<ffi::S32> layer_index, ffi::Buffer<ffi::S32> slot_ids,
                        ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = pages.dimensions();
  const auto k_dims = k_new.dimensions();
  const auto v_dims = v_new.dimensions();
  if (dims.size() != 6 || dims[1] != 2)
    return ffi::Error::InvalidArgument("pages must be [L, 2, K, num_pages, page_size, H]");
  const int64_t num_layers = dims[0], num_kv_heads = dims[2], head_dim = dims[5];
  const int64_t num_tokens = slot_ids.element_count();
  if (k_dims.size() != 3 || k_dims[0] != num_tokens || k_dims[1] != num_kv_heads ||
      k_dims[2] != head_dim || v_dims.size() != 3 || v_dims[0] != num_tokens ||
      v_dims[1] != num_kv_heads || v_dims[2] != head_dim)
    return ffi::Error::InvalidArgument("k_new and v_new must be [T, K, H] as the pages' K, H");
  if (k_new.element_type() != pages.element_type() ||
      v_new.element_type() != pages.element_type())
    return ffi::Error::InvalidArgument("k_new and v_new must have the pages' dtype");
  const int64_t layer = layer_index.typed_data()[0];
  if (layer < 0 || layer >= num_layers)
    return ffi::Error::InvalidArgument("layer_index out of range");
  char* dst = pages_in_place(pages, out);
  if (pages.element_count() == 0) return ffi::Error::Success();
  const int64_t row_bytes = head_dim * (pages.size_bytes() / pages.element_count());
  write_rows(dst, pages, layer, static_cast<const char*>(k_new.untyped_data()),
             static_cast<const char*>(v_new.untyped_data()), slot_ids.typed_data(), num_tokens,
             row_bytes);
  return ffi::Error::Success();
}

// float32 to bfloat16 / float16 as XLA's convert: rounded to nearest even, NaN kept NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: inf
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal (or zero) of 2^-24 steps
    float m;
    std::memcpy(&m, &magnitude, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(m * 16777216.0f));
  }
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
#endif
}

// A row of n float32 values into a float page row of `kind`, as kv_cache.to_kv_dtype casts
// it: float16 clipped to its range first (never inf).
void store_row(Kind kind, const float* src, char* dst, int64_t n) {
  if (kind == Kind::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  if (kind == Kind::kBF16) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(src[i]);
    return;
  }
  constexpr float kF16Max = 65504.0f;
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(std::clamp(src[i], -kF16Max, kF16Max));
}

// Rotate-half rotary of a row x [H] (cos, sin [H/2] at its token's position) into out, as
// reference.rotate: x * [cos, cos] + [-x2, x1] * [sin, sin].
inline void rotate(const float* x, int64_t head_dim, const float* cos, const float* sin,
                   float* out) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] + -x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
  }
}

// Rotary, one layer's KV write and attention in one call, reference.attend_layer for float
// pages. qkv [T, K, G + 2, H] float32 before rotary holds, per KV head k, its G query heads
// (query head k * G + g), its key and its value (the fused q/k/v product's rows, fusion.py);
// cos and sin [T, H/2] at each token's position. The keys and values are rounded to the
// pages' dtype and written at slot_ids into the pages (aliased to the second result), then
// attention reads the step's own keys and values as written. On a batch-1 step this is one
// call where the q/k/v split, rotary, two converts, the write and attention were five
// XLA:CPU thunks a layer or more.
ffi::Error WriteAttend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::AnyBuffer pages,
                       ffi::Buffer<ffi::S32> layer_index, ffi::Buffer<ffi::F32> cos,
                       ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> slot_ids,
                       ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> page_rows,
                       ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_starts,
                       ffi::ResultBuffer<ffi::F32> out,
                       ffi::Result<ffi::AnyBuffer> pages_out, float sm_scale,
                       int32_t sliding_window, float logit_softcap) {
  Problem pb;
  ffi::Error error = page_kind(pages, pb);
  if (error.failure()) return error;
  if (pb.kind == Kind::kI8 || pb.kind == Kind::kF8E4M3)
    return ffi::Error::InvalidArgument("pages must be float32, bfloat16 or float16");
  const auto qkv_dims = qkv.dimensions();
  const auto out_dims = out->dimensions();
  if (qkv_dims.size() != 4 || qkv_dims[2] < 3 || out_dims.size() != 3 ||
      out_dims[0] != qkv_dims[0] || out_dims[1] != qkv_dims[1] * (qkv_dims[2] - 2) ||
      out_dims[2] != qkv_dims[3])
    return ffi::Error::InvalidArgument("qkv must be [T, K, G + 2, H] and out [T, K * G, H]");
  error = set_problem(out->dimensions(), pages, layer_index, page_table, page_rows, seq_lens,
                      query_starts, out->typed_data(), sm_scale, sliding_window,
                      logit_softcap, pb);
  if (error.failure()) return error;
  const int64_t t = pb.num_tokens, k = pb.num_kv_heads, h = pb.head_dim;
  const int64_t group = qkv_dims[2] - 2;
  if (qkv_dims[1] != k)
    return ffi::Error::InvalidArgument("qkv's K must be the pages' KV heads");
  if (h % 2 || cos.element_count() != t * (h / 2) || sin.element_count() != t * (h / 2) ||
      slot_ids.element_count() != t)
    return ffi::Error::InvalidArgument("cos and sin must be [T, H/2] (H even), slot_ids [T]");
  // The step's rows, kept per thread (a decode step makes one call a layer).
  static thread_local std::vector<float> q_rotated, k_rotated;
  static thread_local std::vector<char> k_rows, v_rows;
  q_rotated.resize(t * k * group * h);
  k_rotated.resize(h);
  const int64_t row_bytes = h * pb.itemsize;
  k_rows.resize(t * k * row_bytes);
  v_rows.resize(t * k * row_bytes);
  for (int64_t i = 0; i < t; ++i) {
    const float* c = cos.typed_data() + i * (h / 2);
    const float* s = sin.typed_data() + i * (h / 2);
    for (int64_t j = 0; j < k; ++j) {
      const float* heads = qkv.typed_data() + (i * k + j) * (group + 2) * h;
      for (int64_t g = 0; g < group; ++g)
        rotate(heads + g * h, h, c, s, q_rotated.data() + ((i * k + j) * group + g) * h);
      rotate(heads + group * h, h, c, s, k_rotated.data());
      store_row(pb.kind, k_rotated.data(), k_rows.data() + (i * k + j) * row_bytes, h);
      store_row(pb.kind, heads + (group + 1) * h, v_rows.data() + (i * k + j) * row_bytes, h);
    }
  }
  char* dst = pages_in_place(pages, pages_out);
  write_rows(dst, pages, pb.layer, k_rows.data(), v_rows.data(), slot_ids.typed_data(), t,
             row_bytes);
  pb.new_kind = pb.kind;
  pb.new_itemsize = pb.itemsize;
  pb.scales = nullptr;
  pb.q = q_rotated.data();
  pb.k_new = k_rows.data();
  pb.v_new = v_rows.data();
  pb.kv = dst;
  return attend_rows(pool, pb, seq_lens.dimensions()[0]);
}

}  // namespace

// How many items a thread other than their call's ran so far (tests read it).
extern "C" int64_t KsanaAttentionItemsShared() { return items_shared.load(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(KsanaRaggedPagedAttentionCpu, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_new
                                  .Arg<ffi::AnyBuffer>()         // v_new
                                  .Arg<ffi::AnyBuffer>()         // kv
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer_index
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_rows [S] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_starts
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("logit_softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KsanaWriteLayerKvCpu, WriteLayerKV,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pages (aliased to the result)
                                  .Arg<ffi::AnyBuffer>()         // k_new [T, K, H]
                                  .Arg<ffi::AnyBuffer>()         // v_new [T, K, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer_index
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_ids [T]
                                  .Ret<ffi::AnyBuffer>());       // pages

XLA_FFI_DEFINE_HANDLER_SYMBOL(KsanaWriteAttendCpu, WriteAttend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv [T, K, G + 2, H]
                                  .Arg<ffi::AnyBuffer>()  // pages (aliased to the 2nd result)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer_index
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [T, H/2]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [T, H/2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_ids [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_rows [S] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_starts
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, K * G, H]
                                  .Ret<ffi::AnyBuffer>()         // pages
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("logit_softcap"));
