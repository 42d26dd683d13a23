// Vector helpers shared by the C++ CPU kernels (linear_cpu.cc, ragged_paged_attention_cpu.cc).
// cpu_build.py's cache key covers the headers a kernel source includes from this folder.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace ksana_cpu_simd {

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, ~1 ulp),
// branch-free so that a loop of it vectorizes. Rounds with the 1.5 * 2^23 trick (exact for
// |x| < 2^22), since floor/nearbyint only inline under fast-math flags.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace ksana_cpu_simd

#if defined(__AVX512F__)
#include <immintrin.h>

namespace ksana_cpu_simd {

// The lane sums of 16 vectors as the lanes of one vector, in order: a transposing tree of 15
// adds (unpacks and 128-bit shuffles between them), where 16 separate reductions take ~130
// instructions -- at 16+ rows, a third of a [4, 4] tile's time over 576 columns. The vectors
// come by value: an accumulator whose address is taken is stored to the stack at every step
// of the loop that sums into it (GCC 12).
__attribute__((always_inline)) inline __m512 lane_sums16(
    __m512 v0, __m512 v1, __m512 v2, __m512 v3, __m512 v4, __m512 v5, __m512 v6, __m512 v7,
    __m512 v8, __m512 v9, __m512 v10, __m512 v11, __m512 v12, __m512 v13, __m512 v14,
    __m512 v15) {
  auto pair = [](__m512 a, __m512 b) {  // lanes [a0+a2, b0+b2, a1+a3, b1+b3] per 128 bits
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  };
  auto quad = [](__m512 a, __m512 b) {
    const __m512d lo = _mm512_castps_pd(a), hi = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  };
  auto halves = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  const __m512 b0 = quad(pair(v0, v1), pair(v2, v3)), b1 = quad(pair(v4, v5), pair(v6, v7));
  const __m512 b2 = quad(pair(v8, v9), pair(v10, v11));
  const __m512 b3 = quad(pair(v12, v13), pair(v14, v15));
  return halves(halves(b0, b1), halves(b2, b3));
}

}  // namespace ksana_cpu_simd
#endif
