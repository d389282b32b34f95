// y[M, N] = x[M, K] @ w[N, K]^T for few rows M (decode steps, verification blocks, draft trees), fp32, CPU.
//
// Built and loaded by nemo_spec/models/skinny_gemm.py (g++ -O3 -march=native -ffp-contract=off -fopenmp).
// A CPU GEMM library blocks such products for big M; with M of 1-16 it leaves most of the memory bandwidth
// unused, while the product is bound by reading w once. Here each output column o streams its row of w once and
// multiplies it into all M rows of x (which stay in L1), so w is read once for any M up to MAXM; the output
// columns are split over the caller's OpenMP team (torch's own libgomp, so one thread team per process).
//
// Every output element is summed in the same order whatever M is (VW lane partial sums over k, then the lanes
// in order, then the tail), and no multiply-add is contracted: a row's result does not depend on how many rows
// are computed with it, so a verification block gives bit for bit the logits of one-row decode steps.
#include <omp.h>

#if defined(__AVX512F__)
#define VW 16
#define MAXM 24
#else
#define VW 8   // AVX2 / SSE / NEON: GCC lowers the 32-byte vector type to what the target has
#define MAXM 12
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));  // unaligned loads

template <int M>
static void columns(const float* x, const float* w, float* y, long K, long N, long o0, long o1) {
  const long kv = K / VW * VW;
  for (long o = o0; o < o1; ++o) {
    const float* wr = w + o * K;
    vf acc[M];
    for (int m = 0; m < M; ++m) acc[m] = (vf){};
    for (long k = 0; k < kv; k += VW) {
      const vf wv = *(const vfu*)(wr + k);
      for (int m = 0; m < M; ++m) acc[m] += wv * *(const vfu*)(x + m * K + k);
    }
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int j = 0; j < VW; ++j) s += acc[m][j];
      for (long k = kv; k < K; ++k) s += wr[k] * x[m * K + k];
      y[m * N + o] = s;
    }
  }
}

typedef void (*columns_fn)(const float*, const float*, float*, long, long, long, long);

template <int... Ms>
struct Table {
  static constexpr columns_fn fns[sizeof...(Ms)] = {&columns<Ms>...};
};
#if MAXM > 12
static const columns_fn* const kColumns = Table<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                                21, 22, 23, 24>::fns;
#else
static const columns_fn* const kColumns = Table<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>::fns;
#endif

extern "C" int nemo_spec_skinny_max_rows_per_pass() { return MAXM; }

// Rows beyond MAXM are done in ceil(M / MAXM) passes of near-equal size (each pass reads w again).
extern "C" void nemo_spec_skinny_linear(const float* x, const float* w, float* y, long M, long K, long N,
                                        int threads) {
  const long passes = (M + MAXM - 1) / MAXM;
#pragma omp parallel num_threads(threads)
  {
    const long nt = omp_get_num_threads(), t = omp_get_thread_num();
    const long chunk = (N + nt - 1) / nt, o0 = t * chunk, o1 = o0 + chunk < N ? o0 + chunk : N;
    long m0 = 0;
    for (long p = 0; p < passes; ++p) {
      const long mm = (M - m0) / (passes - p);
      if (o0 < o1) kColumns[mm - 1](x + m0 * K, w, y + m0 * N, K, N, o0, o1);
      m0 += mm;
    }
  }
}

// y[M, D] = x[M, D] * rsqrt(mean(x^2) + eps) * w[D] (RMSNorm over the last dim, fp32), one row after another on
// the calling thread: a decode step's norms are a few rows of a few hundred elements, where torch's composite
// rms_norm spends ~30 us in op dispatch. Each row's sum of squares is taken in the same lane order as the product
// above, so a row's result does not depend on the row count either.
extern "C" void nemo_spec_rms_norm(const float* x, const float* w, float* y, long M, long D, float eps) {
  const long dv = D / VW * VW;
  for (long m = 0; m < M; ++m) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    vf acc = (vf){};
    for (long k = 0; k < dv; k += VW) {
      const vf v = *(const vfu*)(xr + k);
      acc += v * v;
    }
    float s = 0.f;
    for (int j = 0; j < VW; ++j) s += acc[j];
    for (long k = dv; k < D; ++k) s += xr[k] * xr[k];
    const float r = 1.0f / __builtin_sqrtf(s / (float)D + eps);
    for (long k = 0; k < D; ++k) yr[k] = xr[k] * r * w[k];
  }
}
