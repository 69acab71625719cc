// eager_ops_triton.py's kernels without Triton, for the cudagraph backend's eager blocks and prefill: RoPE on q and k with
// the cache write, SiLU x up, and RMSNorm (after a residual add). The same roundings as the eager ops: each rotated
// element is fl(fl(x0 c) + fl(x1 (-s))) in float32 (no FMA: common.cuh's rotate), SiLU is x / (1 + expf(-x)) with an
// IEEE division, rounded to the dtype before the product; the norm rounds as model.RMSNorm (the sum, x rstd, then x
// the weight), only its sum of squares in an order of its own. Compiled at run time (NVRTC) by eager_ops_cuda.py, after
// common.cuh.

struct RopeArgs {
  const void* q;          // (B, S, H, HD) by the strides below, each token's heads contiguous
  const void* k;
  const void* v;
  const float* freqs;     // (S, HD / 2, 2): the token's (cos, sin) pairs
  const long long* pos;   // (S,): the tokens' cache positions
  void* q_out;            // (B, S, H, HD) contiguous
  void* kc;               // the caches, (rows, H, positions, HD) by the strides below
  void* vc;
  long long sq_b, sq_s, sk_b, sk_s, sv_b, sv_s, sc_b, sc_h, sc_s;
  int S, H, HD;
};

struct SiluArgs {
  const void* x;  // (M, 2F): [gate | up] per row
  void* out;      // (M, F)
  int F;
};

struct NormArgs {
  const void* x;      // (M, D) rows
  const void* delta;  // (M, D) added to x first, or null
  const void* w;      // (D,) the norm's weight
  void* h;            // (M, D) x + delta (where delta is not null)
  void* y;            // (M, D) the norm of x (+ delta) times w
  int D;
  float eps;
};

static_assert(sizeof(RopeArgs) == 152 && sizeof(SiluArgs) == 24 && sizeof(NormArgs) == 48,
              "eager_ops_cuda.py's ctypes Args mirror these layouts");

// the pair (x0, x1) rotated by (c, s) into p[i], p[i + 1]
template <int F32>
__device__ __forceinline__ void store_rotated(void* p, long long i, float x0, float x1, float c, float s) {
  const float2 y = rotate(x0, x1, c, s);
  store<F32>(p, i, y.x);
  store<F32>(p, i + 1, y.y);
}

// program (s, b): token s of row b, every head; a thread per (head, pair) in turn
template <int F32>
__device__ __forceinline__ void rope_cache(const RopeArgs& a) {
  const int s = blockIdx.x, b = blockIdx.y, half = a.HD / 2;
  const long long pos = a.pos[s];
  for (int i = threadIdx.x; i < a.H * half; i += blockDim.x) {
    const int h = i / half, j = i % half, d = h * a.HD + 2 * j;
    const float c = a.freqs[((long long)s * half + j) * 2], sn = a.freqs[((long long)s * half + j) * 2 + 1];
    const long long q = b * a.sq_b + s * a.sq_s + d, k = b * a.sk_b + s * a.sk_s + d;
    const long long out = ((long long)b * a.S + s) * a.H * a.HD + d;
    const long long cache = b * a.sc_b + h * a.sc_h + pos * a.sc_s + 2 * j, v = b * a.sv_b + s * a.sv_s + d;
    store_rotated<F32>(a.q_out, out, load<F32>(a.q, q), load<F32>(a.q, q + 1), c, sn);
    store_rotated<F32>(a.kc, cache, load<F32>(a.k, k), load<F32>(a.k, k + 1), c, sn);
    store<F32>(a.vc, cache, load<F32>(a.v, v));
    store<F32>(a.vc, cache + 1, load<F32>(a.v, v + 1));
  }
}

// program (m, f block): row m's outputs from f = blockIdx.y * blockDim.x on (rows in x: past 65,535 at a prefill)
template <int F32>
__device__ __forceinline__ void silu_mul(const SiluArgs& a) {
  const int f = blockIdx.y * blockDim.x + threadIdx.x;
  if (f >= a.F) return;
  const long long row = (long long)blockIdx.x * 2 * a.F;
  const float g = load<F32>(a.x, row + f), up = load<F32>(a.x, row + a.F + f);
  float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
  if (!F32) silu = round_bf16(silu);
  store<F32>(a.out, (long long)blockIdx.x * a.F + f, __fmul_rn(silu, up));
}

// program m: row m; thread t its elements t + T i (i < V), held in registers between the sum and the products.
// y = fl(fl(h rstd) w), rstd = rsqrt(sum(h^2) / D + eps) in float32, h = fl(x + delta), as model.RMSNorm's eager ops.
// Every load is issued before the first store: h may alias x or delta for all the compiler knows, so a store between
// them made each element's loads wait for the one before's, an L2 round trip each (~4.7 us a row at 16-64 rows).
template <int F32, int T, int V>
__device__ __forceinline__ void rms_norm(const NormArgs& a) {
  __shared__ float red[T / 32];
  const long long row = (long long)blockIdx.x * a.D;
  float h[V], dh[V], w[V], ss = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int d = threadIdx.x + T * i;
    const bool ok = d < a.D;
    h[i] = ok ? load<F32>(a.x, row + d) : 0.f;
    dh[i] = ok && a.delta ? load<F32>(a.delta, row + d) : 0.f;
    w[i] = ok ? load<F32>(a.w, d) : 0.f;
  }
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int d = threadIdx.x + T * i;
    if (d < a.D && a.delta) {
      h[i] = __fadd_rn(h[i], dh[i]);
      if (!F32) h[i] = round_bf16(h[i]);
      store<F32>(a.h, row + d, h[i]);
    }
    ss = __fadd_rn(ss, __fmul_rn(h[i], h[i]));
  }
  const float rstd = rsqrtf(__fadd_rn(__fdiv_rn(block_reduce<T, 1>(ss, red), (float)a.D), a.eps));
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int d = threadIdx.x + T * i;
    if (d < a.D) {
      float n = __fmul_rn(h[i], rstd);
      if (!F32) n = round_bf16(n);
      store<F32>(a.y, row + d, __fmul_rn(n, w[i]));
    }
  }
}
