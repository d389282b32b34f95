// y[M, N] = x[M, K] @ w[N, K]^T for few rows M (decode steps, verification blocks, draft trees), fp32, CPU.
//
// Built and loaded by nemo_spec/models/skinny_gemm.py (g++ -O3 -march=native -ffp-contract=off -fopenmp).
// A CPU GEMM library blocks such products for big M; with M of 1-16 it leaves most of the memory bandwidth
// unused, while the product is bound by reading w once. Here the output columns are split over the caller's
// OpenMP team (torch's own libgomp, so one thread team per process); each thread walks its weight rows in blocks
// of about BLOCK_BYTES and multiplies every block into the rows of x in groups of at most MAXR rows (one vector
// accumulator per row, the group's rows of x in L1): the first group reads the block from memory, the others
// from cache, so w is read from memory once for any M. (One pass over up to 24 rows, as this kernel did before,
// is bound by the loads of x: its products of 8-40 rows over SmolLM2's layers took 1.4-1.5x as long on an
// AVX-512 host.)
//
// Every output element is summed in the same order whatever M is (VW lane partial sums over k, then the lanes
// in order, then the tail), and no multiply-add is contracted: a row's result does not depend on how many rows
// are computed with it, so a verification block gives bit for bit the logits of one-row decode steps. (Fused
// multiply-adds and a halving lane sum were tried: 2-3 rows ran 1.1-1.4x slower on that host.)
#include <omp.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8  // AVX2 / SSE / NEON: GCC lowers the 32-byte vector type to what the target has
#endif
#define MAXR 6  // rows of x per group (one accumulator each)
#define BLOCK_BYTES 65536  // weight rows per block: about this many bytes

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));  // unaligned loads

// y[r, o] = x[r] . w[o] for the R rows of x and the weight rows o in [o0, o1)
template <int R>
static void columns(const float* x, const float* w, float* y, long K, long N, long o0, long o1) {
  const long kv = K / VW * VW;
  for (long o = o0; o < o1; ++o) {
    const float* wr = w + o * K;
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = (vf){};
    for (long k = 0; k < kv; k += VW) {
      const vf wv = *(const vfu*)(wr + k);
      for (int r = 0; r < R; ++r) acc[r] += wv * *(const vfu*)(x + r * K + k);
    }
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int j = 0; j < VW; ++j) s += acc[r][j];
      for (long k = kv; k < K; ++k) s += wr[k] * x[r * K + k];
      y[r * N + o] = s;
    }
  }
}

typedef void (*columns_fn)(const float*, const float*, float*, long, long, long, long);

template <int... Rs>
struct Table {
  static constexpr columns_fn fns[sizeof...(Rs)] = {&columns<Rs>...};
};
static const columns_fn* const kColumns = Table<1, 2, 3, 4, 5, 6>::fns;

extern "C" void nemo_spec_skinny_linear(const float* x, const float* w, float* y, long M, long K, long N,
                                        int threads) {
  const long groups = (M + MAXR - 1) / MAXR;
  // blocks only where there are later groups to reuse them (one group: one uninterrupted sweep)
  long block = groups == 1 ? N : BLOCK_BYTES / (4 * K);
  if (block < 1) block = 1;
#pragma omp parallel num_threads(threads)
  {
    const long nt = omp_get_num_threads(), t = omp_get_thread_num();
    const long chunk = (N + nt - 1) / nt, o0 = t * chunk < N ? t * chunk : N, o1 = o0 + chunk < N ? o0 + chunk : N;
    for (long b0 = o0; b0 < o1; b0 += block) {
      const long b1 = b0 + block < o1 ? b0 + block : o1;
      long m0 = 0;
      for (long g = 0; g < groups; ++g) {
        const long mm = (M - m0) / (groups - g);
        kColumns[mm - 1](x + m0 * K, w, y + m0 * N, K, N, b0, b1);
        m0 += mm;
      }
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
