// The cudagraph backend's draw in one kernel: CFG merge, temperature, top-k and the exponential race, the token to
// `token` and `out` and the position advanced. S programs per image of T threads; logit j = i * T + t is thread t's
// i-th, and program s holds i = s * PER ... s * PER + PER - 1. Each program makes its logits' race scores (the noise,
// Philox and two logf per logit, is most of the kernel's work: spread over S programs), stores them and its best; the
// image's last program to finish decides, its logits (ALL = S * PER per thread) in registers. Compiled at run time
// (NVRTC) by draw_cuda.py, after common.cuh.
//
// The race: the token is argmax over the kept logits of x - log E, E = -log U, U uniform in (0, 1) from Philox4x32-10
// keyed by the call's seed at a counter unique to (image, position, thread, group of 4 logits): the same distribution
// as torch.multinomial over softmax of the kept logits (sampling.py). Top-k keeps x >= the k-th largest. As
// draw_triton.py's Triton draw, the winner over all logits is checked first: it is top-k's if fewer than k logits
// exceed it; else the next winner, TRIES in all, then the k-th largest by bisection over the floats' order keys.

struct Args {
  const void* logits;      // (rows, V) bf16 or float32, rows `stride` apart: [cond; uncond] if guided
  long long* token;        // (batch,)
  long long* out;          // (batch, tokens), rows `stride_out` apart
  long long* pos;          // the position whose next token is drawn; advanced by the last image's program
  const long long* seed;   // the call's Philox key
  const float* cfg_scale;  // 0-dim
  const float* temperature;
  unsigned long long* count;  // (1 + batch,): [0] images decided, [1 + b] image b's programs done; zero between calls
  unsigned long long* cand;   // (batch, S): each program's best (score, index), as `ranked`
  float* scores;              // (batch, S * PER * T): the race's scores
  long long stride, stride_out, prefix_len;
  int V, batch, top_k;     // top_k 0: no filter
  int guided, sample;      // sample 0: greedy (argmax)
  int pad;
};

static_assert(sizeof(Args) == 128, "draw_cuda.py's ctypes Args mirrors this layout");

constexpr int TRIES = 4;  // race winners checked against top-k before the k-th largest is searched

__device__ __forceinline__ void philox(unsigned c[4], unsigned k0, unsigned k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const unsigned h0 = __umulhi(0xD2511F53u, c[0]), l0 = 0xD2511F53u * c[0];
    const unsigned h1 = __umulhi(0xCD9E8D57u, c[2]), l1 = 0xCD9E8D57u * c[2];
    c[0] = h1 ^ c[1] ^ k0; c[1] = l1; c[2] = h0 ^ c[3] ^ k1; c[3] = l0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
}

// log E for a Philox output r: U = (2 (r >> 9) + 1) / 2^24, exact in float32 and never 0 or 1
__device__ __forceinline__ float log_e(unsigned r) {
  const float u = (float)(2u * (r >> 9) + 1u) * 5.9604644775390625e-8f;
  return logf(-logf(u));
}

// (score, index) as one word whose unsigned order is (score ascending, index descending): the max is argmax's
__device__ __forceinline__ unsigned long long ranked(float s, int j) {
  const unsigned b = __float_as_uint(s + 0.0f);  // + 0.0: -0.0 ties with 0.0, as in torch
  const unsigned key = (b & 0x80000000u) ? ~b : b | 0x80000000u;
  return ((unsigned long long)key << 32) | (unsigned)~j;
}

__device__ __forceinline__ int ranked_index(unsigned long long r) { return (int)~(unsigned)r; }

// signed order keys of float32 x (an involution), as draw_triton's _order_key
__device__ __forceinline__ int order_key(float x) {
  const int b = __float_as_int(x + 0.0f);
  return b ^ ((b >> 31) & 0x7fffffff);
}

// logit j of row r as float32
template <int F32>
__device__ __forceinline__ float logit(const Args& a, int r, int j) {
  return F32 ? ((const float*)a.logits)[r * a.stride + j] : from_bf16(((const bf16_t*)a.logits)[r * a.stride + j]);
}

// image b's logit x (and its unguided row's u), CFG-merged and divided by the temperature in sampling.py's float32
// roundings (no fused multiply-add)
__device__ __forceinline__ float temper(const Args& a, float x, float u, float scale, float temperature) {
  if (a.guided) x = __fadd_rn(u, __fmul_rn(__fsub_rn(x, u), scale));
  return __fdiv_rn(x, temperature);
}

// image b's logit j, tempered
template <int F32>
__device__ __forceinline__ float tempered(const Args& a, int b, int j, float scale, float temperature) {
  return temper(a, logit<F32>(a, b, j), a.guided ? logit<F32>(a, a.batch + b, j) : 0.f, scale, temperature);
}

// thread t's tempered logits of image b, its i0-th to (i0 + N - 1)-th (logit j = i * T + t), to x; -inf past V. All
// loads first (past V the last logit again, unused): the division branches (its check and slow path), and loads after
// it had waited for the logit before's to land
template <int T, int N, int F32>
__device__ __forceinline__ void tempered_row(float* x, const Args& a, int b, int i0, float scale, float temperature) {
  float u[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int j = min((i0 + i) * T + (int)threadIdx.x, a.V - 1);
    x[i] = logit<F32>(a, b, j);
    u[i] = a.guided ? logit<F32>(a, a.batch + b, j) : 0.f;
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
    x[i] = (i0 + i) * T + (int)threadIdx.x < a.V ? temper(a, x[i], u[i], scale, temperature) : NEG_INF;
}

// the race's scores of thread t's tempered logits x of image b, its i0-th to (i0 + PER - 1)-th (i0 a multiple of 4):
// x - log E, or x where greedy; -inf past V
template <int T, int PER>
__device__ __forceinline__ void scores(const float* x, float* s, const Args& a, int b, int i0, long long pos,
                                       unsigned long long seed) {
#pragma unroll
  for (int i = 0; i < PER; i += 4) {
    unsigned c[4] = {(unsigned)((i0 + i) / 4), threadIdx.x, (unsigned)pos, (unsigned)b};  // unique per logit and step
    if (a.sample) philox(c, (unsigned)seed, (unsigned)(seed >> 32));
#pragma unroll
    for (int q = 0; q < 4 && i + q < PER; ++q)
      s[i + q] = (i0 + i + q) * T + threadIdx.x >= a.V ? NEG_INF : a.sample ? x[i + q] - log_e(c[q]) : x[i + q];
  }
}

template <int T, int PER, int S, int F32>
__device__ __forceinline__ void draw(const Args& a) {
  constexpr int ALL = S * PER;  // logits per thread over the image
  __shared__ unsigned long long red[32];
  __shared__ int deciding;
  const int p = blockIdx.x, b = blockIdx.y, t = threadIdx.x;
  const float scale = *a.cfg_scale, temperature = fmaxf(*a.temperature, 1e-5f);
  const unsigned long long seed = (unsigned long long)*a.seed;
  float* const sc = a.scores + (long long)b * ALL * T;
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the logits, and the position (the prefill sets it just before)
  const long long pos = *a.pos;
  // this program's logits: their scores stored, their best to cand
  unsigned long long best = 0;
  {
    float x[PER], s[PER];
    tempered_row<T, PER, F32>(x, a, b, p * PER, scale, temperature);
    scores<T, PER>(x, s, a, b, p * PER, pos, seed);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int j = (p * PER + i) * T + t;
      sc[j] = s[i];
      const unsigned long long r = ranked(s[i], j);
      best = r > best ? r : best;
    }
  }
  best = block_reduce<T, 0>(best, red);
  if (t == 0) {
    a.cand[b * S + p] = best;
    __threadfence();
    deciding = atomicAdd(a.count + 1 + b, 1ull) == S - 1;
  }
  __syncthreads();
  if (!deciding) return;
  // the image's last program decides: the others' scores and bests are visible (each fenced before its count)
  __threadfence();
#pragma unroll
  for (int q = 0; q < S; ++q) {
    const unsigned long long r = __ldcg(a.cand + b * S + q);
    best = r > best ? r : best;
  }
  if (a.top_k > 0) {
    float x[ALL];
    tempered_row<T, ALL, F32>(x, a, b, 0, scale, temperature);
    // kept if fewer than k logits exceed its own; else the next winner in rank, TRIES in all
    bool kept = false;
    for (int tr = 0; tr < TRIES && !kept; ++tr) {
      if (tr > 0) {
        unsigned long long next = 0;
#pragma unroll
        for (int i = 0; i < ALL; ++i) {
          const unsigned long long r = ranked(__ldcg(sc + i * T + t), i * T + t);
          next = r < best && r > next ? r : next;
        }
        best = block_reduce<T, 0>(next, red);
      }
      const float xw = tempered<F32>(a, b, ranked_index(best), scale, temperature);
      int above = 0;
#pragma unroll
      for (int i = 0; i < ALL; ++i) above += x[i] > xw;
      kept = block_reduce<T, 1>((unsigned long long)above, red) < (unsigned long long)a.top_k;
    }
    if (!kept) {
      // the k-th largest: the largest key lo with at least k keys >= lo, by bisection (one block-wide count a pass)
      long long lo = -2147483648LL, hi = 2147483647LL;
      while (lo < hi) {
        const long long mid = (lo + hi + 1) >> 1;
        int n = 0;
#pragma unroll
        for (int i = 0; i < ALL; ++i) n += i * T + t < a.V && order_key(x[i]) >= mid;
        const long long count = (long long)block_reduce<T, 1>((unsigned long long)n, red);
        lo = count >= a.top_k ? mid : lo;
        hi = count > a.top_k ? hi : count == a.top_k ? mid : mid - 1;
      }
      unsigned long long next = 0;
#pragma unroll
      for (int i = 0; i < ALL; ++i) {
        const unsigned long long r = ranked(__ldcg(sc + i * T + t), i * T + t);
        next = i * T + t < a.V && order_key(x[i]) >= lo && r > next ? r : next;
      }
      best = block_reduce<T, 0>(next, red);
    }
  }
  if (t == 0) {
    const long long w = ranked_index(best);
    a.token[b] = w;
    a.out[b * a.stride_out + pos - a.prefix_len + 1] = w;
    a.count[1 + b] = 0;
    __threadfence();
    if (atomicAdd(a.count, 1ull) == (unsigned long long)(a.batch - 1)) {  // every program has read the position
      *a.pos = pos + 1;
      *a.count = 0;
    }
  }
}
