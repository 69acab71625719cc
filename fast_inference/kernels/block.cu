// The GEMV path's projections (one token, a few rows) with their weights staged in shared memory before the PDL
// wait: each warp owns a few weight rows, which bulk copies (one per lane) bring into shared memory while the kernel
// before still runs; after the wait the rows of x go to shared memory and each lane multiplies 8 weights per
// 256-wide chunk of K, the sums reduced across the warp by shuffles. Compiled at run time (NVRTC) by block_cuda.py,
// which names the instantiations, after common.cuh; no headers, so that NVRTC needs none.
// bf16 in and out, float32 sums; every rounding where the model rounds (block_triton's kernels do the same).

struct Args {
  const bf16_t* w;       // weights (N, K); gate/up: [w1; w3] (2F, K)
  const bf16_t* x;       // input rows (XR, K)
  const bf16_t* norm;    // RMSNorm weight (K,): qkv, gate/up
  const bf16_t* res;     // residual (XR, N): linear
  const bf16_t* add;     // rows added after the residual (XR, N): linear with ADD
  bf16_t* out;           // linear (XR, N); gate/up (XR, F); qkv: q (XR, D)
  const float* freqs;    // qkv: the position's RoPE row, (cos, sin) per pair
  const long long* pos;  // qkv: the position
  bf16_t* kc;            // qkv: the key cache, (rows, heads, positions, head dim) by the strides below
  bf16_t* vc;            // qkv: the value cache, same strides
  int* progress;         // a prefetcher's count, bumped as the kernel starts, or null
  long long sr, sh, sn;  // cache strides in elements
  int n;                 // output columns: linear N, gate/up F, qkv 3 D
  int hd;                // qkv: head dim
  float eps;             // RMSNorm
};

static_assert(sizeof(Args) == 128, "block_cuda.py's ctypes Args mirrors this layout");

enum { LINEAR = 0, LINEAR_ADD = 1, GATE_UP = 2, QKV = 3 };
enum { NO_PDL = 0, EARLY = 1, FIRST = 3 };  // as pdl.py: the next kernel launches after this one's wait, or before

// REGIONS runs of `bytes` bytes (src + i * gap elements) into dst back to back, a bulk copy per lane, all completing
// on the warp's mbarrier (initialised here by lane 0, its byte count set before any lane copies).
template <int REGIONS>
__device__ __forceinline__ void stage(unsigned char* dst, const bf16_t* src, long long gap, int bytes, unsigned bar,
                                      int lane) {
  if (lane == 0) expect_bytes(bar, bytes * REGIONS);
  __syncwarp();
  constexpr int LANES = 32 / REGIONS;
  const int region = lane / LANES, piece = bytes / LANES;
  bulk(dst + region * bytes + (lane % LANES) * piece, (const char*)(src + region * gap) + (lane % LANES) * piece,
       piece, bar);
}

// One program: NW warps, each with RPW output columns (gate/up: RPW of w1 and the same RPW of w3), XR rows of x.
template <int EPI, int K, int NW, int RPW, int XR, int PDL>
__device__ __forceinline__ void project(const Args& a) {
  constexpr int REGIONS = EPI == GATE_UP ? 2 : 1;
  constexpr int WR = RPW * REGIONS;  // weight rows per warp
  constexpr int KV = K / 8;          // 16-byte vectors per row
  constexpr int NORM = EPI == GATE_UP || EPI == QKV;
  static_assert(K % 256 == 0 && (RPW * K * 2) % (16 * 32 / REGIONS) == 0, "whole chunks and 16-byte pieces");
  static_assert(RPW * XR <= 32, "a lane per output");
  static_assert(EPI != QKV || RPW % 2 == 0, "RoPE's pairs within a warp");
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned long long* bars = (unsigned long long*)smem;
  unsigned char* ws = smem + 128 + warp * WR * K * 2;
  uint4* xs = (uint4*)(smem + 128 + NW * WR * K * 2);
  const int col0 = (blockIdx.x * NW + warp) * RPW;  // this warp's first output column
  const unsigned bar = saddr(&bars[warp]);

  if (a.progress && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(a.progress, 1);  // relaxed: pacing only
  if (PDL == FIRST) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  stage<REGIONS>(ws, a.w + (long long)col0 * K, (long long)a.n * K, RPW * K * 2, bar, lane);
  uint4 nw[K / 256];  // the norm's weights (weights: before the wait too)
  if (NORM)
#pragma unroll
    for (int j = 0; j < K / 256; ++j) nw[j] = ((const uint4*)a.norm)[j * 32 + lane];
  long long pos = 0;
  if (EPI == QKV) pos = __ldcg(a.pos);  // the previous step wrote it
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (PDL == EARLY) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  // this lane's output: (row r, column a) for lane = a * XR + r
  const int mine_a = lane / XR, mine_r = lane % XR;
  const bool owner = lane < RPW * XR;
  float res = 0.f, add = 0.f;
  if (EPI == LINEAR || EPI == LINEAR_ADD) {
    if (owner) res = from_bf16(__ldcg(a.res + (long long)mine_r * a.n + col0 + mine_a));
    if (EPI == LINEAR_ADD && owner) add = from_bf16(__ldcg(a.add + (long long)mine_r * a.n + col0 + mine_a));
  }
  // x from L2 into shared memory by asynchronous copies, all in flight at once: through registers, the compiler
  // issued the loads one to four at a time, each batch's stores waiting for it before the next batch's loads
  for (int i = threadIdx.x; i < XR * KV; i += NW * 32) copy_async16(xs + i, (const uint4*)a.x + i);
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  float rstd[XR];
  if (NORM) {  // every warp its own statistics, from shared memory
#pragma unroll
    for (int r = 0; r < XR; ++r) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < K / 256; ++j) {
        float f[8];
        unpack(xs[r * KV + j * 32 + lane], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(f[e], f[e], s);
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      rstd[r] = rsqrtf(s / K + a.eps);
    }
  }
  wait_phase0(bar);

  float acc[WR][XR];
#pragma unroll
  for (int i = 0; i < WR; ++i)
#pragma unroll
    for (int r = 0; r < XR; ++r) acc[i][r] = 0.f;
  const uint4* wv = (const uint4*)ws;
#pragma unroll
  for (int j = 0; j < K / 256; ++j) {
    float xf[XR][8];
    float g[8];
    if (NORM) unpack(nw[j], g);
#pragma unroll
    for (int r = 0; r < XR; ++r) {
      unpack(xs[r * KV + j * 32 + lane], xf[r]);
      if (NORM)  // RMSNorm's rounding order (block_triton._rmsnorm)
#pragma unroll
        for (int e = 0; e < 8; ++e) xf[r][e] = round_bf16(round_bf16(xf[r][e] * rstd[r]) * g[e]);
    }
#pragma unroll
    for (int i = 0; i < WR; ++i) {
      float w[8];
      unpack(wv[i * KV + j * 32 + lane], w);
#pragma unroll
      for (int r = 0; r < XR; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][r] = fmaf(w[e], xf[r][e], acc[i][r]);
    }
  }
#pragma unroll
  for (int i = 0; i < WR; ++i)
#pragma unroll
    for (int r = 0; r < XR; ++r) {
#pragma unroll
      for (int o = 16; o; o >>= 1) acc[i][r] += __shfl_xor_sync(0xffffffffu, acc[i][r], o);
      acc[i][r] = round_bf16(acc[i][r]);  // the linear's output, as the model rounds it
    }

  if (EPI == QKV) {  // lanes a pair each: (row r, pair p) for lane = p * XR + r
    const int p = lane / XR, r = lane % XR;
    float e = 0.f, o = 0.f;
#pragma unroll
    for (int i = 0; i < RPW / 2; ++i)
#pragma unroll
      for (int rr = 0; rr < XR; ++rr)
        if (i == p && rr == r) e = acc[2 * i][rr], o = acc[2 * i + 1][rr];
    if (lane >= RPW / 2 * XR) return;
    const int D = a.n / 3, col = col0 + 2 * p, section = col / D, h = col % D / a.hd, d = col % a.hd;
    if (section < 2) {  // rotate by this position's (cos, sin), in float32 as the model
      const float c = a.freqs[d], s = a.freqs[d + 1];
      const float e2 = e * c - o * s, o2 = o * c + e * s;
      e = e2, o = o2;
    }
    bf16_t* at = section == 0 ? a.out + (long long)r * D + h * a.hd + d
                              : (section == 1 ? a.kc : a.vc) + r * a.sr + h * a.sh + pos * a.sn + d;
    at[0] = to_bf16(e);
    at[1] = to_bf16(o);
    return;
  }
  float y = 0.f, u = 0.f;
#pragma unroll
  for (int i = 0; i < RPW; ++i)
#pragma unroll
    for (int r = 0; r < XR; ++r)
      if (i == mine_a && r == mine_r) {
        y = acc[i][r];
        if (EPI == GATE_UP) u = acc[RPW + i][r];
      }
  if (!owner) return;
  if (EPI == GATE_UP) {  // SiLU(gate) rounded, times up
    a.out[(long long)mine_r * a.n + col0 + mine_a] = to_bf16(round_bf16(y / (1.f + expf(-y))) * u);
    return;
  }
  float v = round_bf16(y + res);
  if (EPI == LINEAR_ADD) v = round_bf16(v + add);
  a.out[(long long)mine_r * a.n + col0 + mine_a] = to_bf16(v);
}

// block_cuda.py appends a line per instantiation:
// extern "C" __global__ void __launch_bounds__(NW * 32) NAME(const Args a) { project<EPI, K, NW, RPW, XR, PDL>(a); }
