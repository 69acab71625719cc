// A persistent chain of GPT-XL's four projections at XR rows (GEMVs only: no norms, attention or residuals), one
// program per SM, measured by scripts/persistent_chain_probe.py (docs/PERF_NOTES.md, "A persistent chain of the
// projections"). A producer lane streams this SM's weight units (8 output rows each) into a ring of shared-memory
// stages with bulk copies, running ahead across phases and layers; the consumer warps wait for the phase's input,
// stage x in shared memory and multiply each unit as it lands. Three consumers:
//   run:     16 warps in two groups of 8 taking units in turn, a weight row per warp, fp32 FMAs; a grid-wide count;
//   run_mma: a warp per unit, mma.sync m16n8k16 with the unit's rows as B's columns; a grid-wide count;
//   run_ll:  NW warps per unit on the tensor cores; the values carry their own flags (the fastest).
// The tensor-core consumers take up to 16 rows (n = 8). Modes that take the chain apart: COPY 1 consumers only take
// and free stages; COPY 2 no copies (products on the ring as it is); COPY 3 (run_mma, run_ll) neither; COPY 4
// (run_ll) the producer alone; BARRIERS / WAIT 0 skip the waits for the phase's input (results then wrong).
typedef unsigned short bf16_t;
struct PArgs {
  const bf16_t* wqkv; const bf16_t* wo; const bf16_t* w13; const bf16_t* w2;
  bf16_t* x; bf16_t* qkv; bf16_t* h; bf16_t* gu;
  unsigned* counters;
  int layers, nsm;
  unsigned long long* stamps;  // [SM 0, the last SM][layers][4 phases][16]: globaltimer and clock64 stamps
  uint2 *xll, *qkvll, *hll, *gull;  // run_ll's activations: {two bf16, the flag of the phase that wrote them}
  // run_ll's EPI: the block's other work, as decode_block's kernels do it
  const bf16_t* nw;    // [layers][2][D]: attention_norm's and ffn_norm's weights
  const float* freqs;  // [HD / 2][2]: the step's (cos, sin) per pair of a head's columns
  bf16_t *kc, *vc;     // [layers][XR][D]: the step's keys and values, as the caches get them
  float eps;
  uint4* sqll;  // EPI 3: [2][CW][D / 8] wo's and w2's units' sums of squares of their outputs' two rows, flagged (x's,
                // h's), a copy for each consumer warp
  unsigned long long* ends;  // run_ll: [layers][4 phases][SM] the time each SM's consumers are done with the phase
};
__device__ __forceinline__ unsigned long long now() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
constexpr int D = 1280, F = 3584, HD = 64, S = 7, CW = 16, W2P = 2;  // ring stages, consumer warps, w2 pieces (the probe may change S, W2P)
// w2's rows go through the ring in W2P pieces of K (w2_len(h) elements from w2_start(h)), each a stage
constexpr int W2K = (F / W2P + 255) / 256 * 256;
constexpr int STAGE = (8 * D * 2 > 8 * W2K * 2 ? 8 * D * 2 : 8 * W2K * 2);  // bytes
__device__ __forceinline__ int w2_start(int h) { return h * W2K; }
__device__ __forceinline__ int w2_len(int h) { return h < W2P - 1 ? W2K : F - (W2P - 1) * W2K; }
constexpr int W2LAST = F - (W2P - 1) * W2K;
// the consumers' exchange at XR rows: run_ll's partials, [CW warps][2 units][lanes holding rows][a lane's values]
__host__ __device__ constexpr int exch_bytes(int xr) { return CW * 2 * (4 * xr < 32 ? 4 * xr : 32) * (xr > 8 ? 4 : 2) * 4; }
// run_ll's EPI at up to 8 rows: the residual's rows, the norm's partial sums [CW][XR] and the RoPE table [HD]
__host__ __device__ constexpr int epi_bytes(int xr) { return xr <= 8 ? xr * D * 2 + CW * xr * 4 + HD * 4 : 0; }
// what a program asks for at XR rows (the probe's SMEM): the ring's barriers, its stages, x, the exchange, EPI's
__host__ __device__ constexpr int smem_bytes(int xr) { return 128 + S * STAGE + xr * F * 2 + exch_bytes(xr) + epi_bytes(xr); }

__device__ __forceinline__ unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi(unsigned u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ bf16_t to_bf16(float f) { unsigned u = __float_as_uint(f); return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
__device__ __forceinline__ float rb(float f) { return __uint_as_float((unsigned)to_bf16(f) << 16); }

__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk(unsigned dst, const void* src, int bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 512;" ::: "memory"); }
__device__ __forceinline__ void group_sync(int g) { asm volatile("bar.sync %0, 256;" ::"r"(2 + g) : "memory"); }

// the ring's barriers: full[s] completes when stage s has landed, empty[s] when its `consumers` warps are done with it
__device__ __forceinline__ void init_ring(unsigned long long* full, unsigned long long* empty, unsigned consumers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&full[s])) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(&empty[s])), "r"(consumers) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}
// the stamps of (layer l, phase p) on SM 0 and the last SM, else null; `stamps` only for their thread 0
__device__ __forceinline__ unsigned long long* stamp_row(const PArgs& a, int l, int p) {
  const int sm = blockIdx.x;
  return sm == 0 || sm == a.nsm - 1 ? a.stamps + (((sm ? 1 : 0) * a.layers + l) * 4 + p) * 16 : nullptr;
}
__device__ __forceinline__ unsigned long long* stamps(const PArgs& a, int l, int p) {
  return threadIdx.x == 0 ? stamp_row(a, l, p) : nullptr;
}

// dynamic shared memory: the ring's barriers, its stages, x's rows, the consumers' exchange
struct Smem {
  unsigned long long *full, *empty;
  unsigned char* ring;
  bf16_t* xs;
  float* exch;
  bf16_t* res;  // EPI: the rows of the residual add
  float* red;   // EPI: the norm's partial sums
  float* rope;  // EPI 2: the RoPE table
};
template <int XR>
__device__ __forceinline__ Smem smem_layout() {
  static_assert(smem_bytes(XR) <= 227 * 1024, "the ring, x and the exchange fit a program's shared memory");
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned long long* full = (unsigned long long*)smem;
  bf16_t* xs = (bf16_t*)(smem + 128 + S * STAGE);
  float* exch = (float*)(xs + XR * F);
  bf16_t* res = (bf16_t*)(exch + exch_bytes(XR) / 4);
  float* red = (float*)(res + XR * D);
  return {full, full + S, smem + 128, xs, exch, res, red, red + CW * XR};
}

// phase p's geometry: rows per unit 8; K; units (w2: row groups, W2P pieces each)
__device__ __forceinline__ int units(int p) { return p == 0 ? 3 * D / 8 : p == 1 ? D / 8 : p == 2 ? F / 4 : D / 8; }

// the consumers wait until phase `prev`'s count reaches `want` (run and run_mma's grid-wide waits)
__device__ __forceinline__ void wait_count(const PArgs& a, int prev, unsigned want) {
  if (threadIdx.x == 0) {
    unsigned c = 0;
    do asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(c) : "l"(a.counters + prev) : "memory");
    while (c < want);
  }
  consumers_sync();
}
// phase p's input (x, qkv's first D, h, SiLU x up), XR rows, from L2 into xs [XR][K]
// XB: a thread's 16-byte pieces loaded at once (one at a time, each waits for L2); more spill at 96 registers
template <int XR, int XB = 4>
__device__ __forceinline__ void stage_x(const PArgs& a, int p, bf16_t* xs) {
  const int K = p == 3 ? F : D, n = XR * K / 8;
  const auto src = [&](int i) {
    const int r = i / (K / 8), k = (i % (K / 8)) * 8;
    return (const uint4*)((p == 0 ? a.x + r * D : p == 1 ? a.qkv + r * 3 * D : p == 2 ? a.h + r * D : a.gu + r * F) + k);
  };
  for (int base = threadIdx.x; base < n; base += XB * 512) {
    uint4 v[XB];
#pragma unroll
    for (int j = 0; j < XB; ++j)
      if (base + j * 512 < n) v[j] = __ldcg(src(base + j * 512));
#pragma unroll
    for (int j = 0; j < XB; ++j)
      if (base + j * 512 < n) ((uint4*)xs)[base + j * 512] = v[j];
  }
}
// run and run_mma's start of phase (l, p): wait until the phase before is counted (per SM, or per unit with
// per_unit), stage x with XB loads at once (unless !stage), and meet; the stamps of each step on st
template <int XR, int XB>
__device__ __forceinline__ void counted_input(const PArgs& a, int l, int p, bool wait, bool per_unit, bool stage,
                                              bf16_t* xs, unsigned long long* st) {
  if (st) st[0] = now();
  const int prev = l * 4 + p - 1;
  if (prev >= 0 && wait) wait_count(a, prev, per_unit ? units(prev % 4) : a.nsm);
  if (st) st[5] = now();
  if (stage) stage_x<XR, XB>(a, p, xs);
  if (st) st[1] = now();
  consumers_sync();
  if (st) st[2] = now();
}
// SiLU of the gate times up, each rounded to bf16 as the model's ops are (the result left for its store to round)
__device__ __forceinline__ float silu_up(float g, float up) {
  g = rb(g);
  return rb(g / (1.f + expf(-g))) * rb(up);
}

// J 16-byte loads per lane, unrolled: the accumulators stay in registers; x(r, j): row r's 8 values at this lane's
// j-th load (from shared memory, or registers with XREG)
template <int XR, int J, class X>
__device__ __forceinline__ void dots(const uint4* wrow, int lane, float (&acc)[XR][2], X x) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const uint4 w = wrow[j * 32 + lane];
    const float wf[8] = {lo(w.x), hi(w.x), lo(w.y), hi(w.y), lo(w.z), hi(w.z), lo(w.w), hi(w.w)};
#pragma unroll
    for (int r = 0; r < XR; ++r) {
      const uint4 xv = x(r, j);
      float& c = acc[r][j & 1];
      c = fmaf(wf[0], lo(xv.x), c); c = fmaf(wf[1], hi(xv.x), c);
      c = fmaf(wf[2], lo(xv.y), c); c = fmaf(wf[3], hi(xv.y), c);
      c = fmaf(wf[4], lo(xv.z), c); c = fmaf(wf[5], hi(xv.z), c);
      c = fmaf(wf[6], lo(xv.w), c); c = fmaf(wf[7], hi(xv.w), c);
    }
  }
}

struct Cursor { int l, p, u, half; };  // half: w2's piece of K (0 .. W2P - 1; halves by default)
__device__ __forceinline__ bool advance(Cursor& c, int sm, int nsm, int layers) {  // the next unit of this SM's order
  if (c.p == 3 && c.half < W2P - 1) { ++c.half; return true; }
  c.half = 0;
  for (c.u += nsm; c.u >= units(c.p); c.u = sm)
    if (++c.p == 4) { c.p = 0; if (++c.l == layers) return false; }
  return true;
}
__device__ __forceinline__ void piece(bool prefetch, unsigned dst, const bf16_t* src, int bytes, unsigned bar) {
  if (prefetch) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
  else bulk(dst, src, bytes, bar);
}
template <bool PREFETCH>
__device__ __forceinline__ void issue(const PArgs& a, const Cursor& c, unsigned dst, unsigned bar) {
  const int bytes = c.p == 3 ? 8 * w2_len(c.half) * 2 : 8 * D * 2;
  if (!PREFETCH) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  if (c.p < 2) {
    const bf16_t* w = c.p == 0 ? a.wqkv + (long long)c.l * 3 * D * D : a.wo + (long long)c.l * D * D;
    piece(PREFETCH, dst, w + (long long)c.u * 8 * D, 8 * D * 2, bar);
  } else if (c.p == 2) {  // gate rows 4u.. and up rows F + 4u..
    const bf16_t* w = a.w13 + (long long)c.l * 2 * F * D + (long long)c.u * 4 * D;
    piece(PREFETCH, dst, w, 4 * D * 2, bar);
    piece(PREFETCH, dst + 4 * D * 2, w + (long long)F * D, 4 * D * 2, bar);
  } else {  // 8 rows' piece c.half of K, packed
    const bf16_t* w = a.w2 + (long long)c.l * D * F + (long long)c.u * 8 * F + w2_start(c.half);
    const int len = w2_len(c.half);
    for (int r = 0; r < 8; ++r) piece(PREFETCH, dst + r * len * 2, w + (long long)r * F, len * 2, bar);
  }
}

// the producer lane: this SM's units in order into the ring; a second cursor AHEAD units further prefetches into L2
template <int COPY, int AHEAD>
__device__ __forceinline__ void produce(const PArgs& a, unsigned long long* full, unsigned long long* empty, unsigned char* ring, int sm, int nsm, int lane) {
  if (lane || COPY == 2) return;  // COPY 2: no copies, the consumers compute on the ring as it is
  Cursor c{0, 0, sm, 0}, f{0, 0, sm, 0};
  bool more = true, fmore = true;
  for (int i = 0; i < AHEAD && fmore; ++i) { issue<true>(a, f, 0, 0); fmore = advance(f, sm, nsm, a.layers); }
  int n = 0;
  for (; more; ++n, more = advance(c, sm, nsm, a.layers)) {
    if (AHEAD && fmore) { issue<true>(a, f, 0, 0); fmore = advance(f, sm, nsm, a.layers); }
    const int s = n % S;
    if (n >= S) wait_parity(saddr(COPY == 4 ? &full[s] : &empty[s]), ((n / S) - 1) & 1);  // 4: its own landing
    unsigned long long* st = c.u == sm && c.half == 0 ? stamp_row(a, c.l, c.p) : nullptr;
    if (st) st[7] = now();
    issue<false>(a, c, saddr(ring + s * STAGE), saddr(&full[s]));
  }
  if (COPY == 4)  // the last copies land before the program ends
    for (int k = n > S ? n - S : 0; k < n; ++k) wait_parity(saddr(&full[k % S]), (k / S) & 1);
}

// a program's start: the ring's barriers (empty[s] awaits `consumers` warps); the producer warp streams, then is
// done (true)
template <int COPY, int AHEAD>
__device__ __forceinline__ bool producer_done(const PArgs& a, const Smem& m, unsigned consumers) {
  init_ring(m.full, m.empty, consumers);
  if (threadIdx.x >> 5 != CW) return false;
  produce<COPY, AHEAD>(a, m.full, m.empty, m.ring, blockIdx.x, a.nsm, threadIdx.x & 31);
  return true;
}

// AHEAD: units prefetched into L2 ahead of the ring; XREG: x's fragment in registers for the phase (K = D)
template <int XR, int COPY, int BARRIERS, int AHEAD, int XREG>
__device__ void run(const PArgs& a) {
  const Smem m = smem_layout<XR>();
  unsigned long long *full = m.full, *empty = m.empty;
  unsigned char* ring = m.ring;
  bf16_t* xs = m.xs;
  float* exch = m.exch;  // [group][2][8 rows][XR]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sm = blockIdx.x, nsm = a.nsm;
  if (producer_done<COPY, AHEAD>(a, m, 8)) return;  // empty: one group's warps

  // consumers
  int n = 0;
  for (int l = 0; l < a.layers; ++l)
    for (int p = 0; p < 4; ++p) {
      const int K = p == 3 ? F : D;
      unsigned long long* st = stamps(a, l, p);
      // the phase's input, written by the phase before on every SM (each counts it once); x in registers leaves none
      // for loads at once
      counted_input<XR, XREG ? 1 : 4>(a, l, p, BARRIERS, false, true, xs, st);
      uint4 xr[XR][D / 256];  // x's fragment of this lane for the phase (K = D), loaded once: shared memory's reads are the bound
      if (XREG && p < 3)
        #pragma unroll
        for (int r = 0; r < XR; ++r)
          #pragma unroll
          for (int j = 0; j < D / 256; ++j) xr[r][j] = *(const uint4*)(xs + r * D + j * 256 + lane * 8);
      float acc[XR][2];
      const int group = warp / 8, gw = warp % 8;
      int mine = 0;  // this SM's unit ordinal in the phase: group (ordinal % 2) takes it
      for (int u = sm; u < units(p); u += nsm, ++mine)
        for (int half = 0; half < (p == 3 ? W2P : 1); ++half, ++n) {
          if (mine % 2 != group) continue;
          const int s = n % S, L = p == 3 ? w2_len(half) : D, koff = p == 3 ? w2_start(half) : 0;
          if (COPY != 2) wait_parity(saddr(&full[s]), (n / S) & 1);
          if (st && u == sm && half == 0) { st[6] = now(); st[8] = clock64(); }
          if (COPY == 1) {
            __syncwarp();
            if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(&empty[s])) : "memory");
            continue;
          }
          if (half == 0)
            #pragma unroll
            for (int r = 0; r < XR; ++r) acc[r][0] = acc[r][1] = 0.f;
          const uint4* wrow = (const uint4*)(ring + s * STAGE + gw * L * 2);
          const auto from_smem = [=](int r, int j) { return *(const uint4*)(xs + r * K + koff + j * 256 + lane * 8); };
          if (p == 3 && L == W2K) dots<XR, W2K / 256>(wrow, lane, acc, from_smem);
          else if (p == 3) dots<XR, W2LAST / 256>(wrow, lane, acc, from_smem);
          else if (XREG) dots<XR, D / 256>(wrow, lane, acc, [&](int r, int j) { return xr[r][j]; });
          else dots<XR, D / 256>(wrow, lane, acc, from_smem);
          if (st && u == sm && half == 0) st[9] = clock64();
          __syncwarp();
          if (lane == 0 && COPY != 2) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(&empty[s])) : "memory");
          if (p == 3 && half < W2P - 1) continue;
          if (st && u == sm) st[10] = clock64();
          float res[XR];
          #pragma unroll
          for (int r = 0; r < XR; ++r) {
            float v = acc[r][0] + acc[r][1];
            for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            res[r] = v;
          }
          float v = 0.f;
          #pragma unroll
          for (int r = 0; r < XR; ++r) if (r == lane) v = res[r];
          if (p == 2) {  // SiLU(gate) rounded, times up: the gate row's warp and the up row's meet in shared memory
            float* ex = exch + (group * 2 + (mine / 2) % 2) * 8 * XR;
            if (lane < XR) ex[gw * XR + lane] = rb(v);
            group_sync(group);
            if (gw < 4 && lane < XR) {
              a.gu[lane * F + u * 4 + gw] = to_bf16(silu_up(ex[gw * XR + lane], ex[(gw + 4) * XR + lane]));
            }
            continue;
          }
          if (lane < XR) {
            const int col = u * 8 + gw;
            bf16_t* out = p == 0 ? a.qkv + lane * 3 * D : p == 1 ? a.h + lane * D : a.x + lane * D;
            out[col] = to_bf16(v);
          }
        }
      if (st) { st[3] = now(); st[11] = clock64(); }
      consumers_sync();  // as cooperative groups' grid sync: the block's writes, then one fence and the count
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(a.counters + l * 4 + p, 1u);
      }
      if (st) st[4] = now();
    }
}

// the tensor-core consumer: a warp owns whole units (ordinal % 16), mma.sync m16n8k16 with the unit's 8 weight rows as
// B's 8 columns and x's XR rows (up to 16) as A's rows. K is relabelled within each 32-wide chunk, the same way for x
// and W: a lane's 16-byte load at chunk + 8 q of weight row g (x rows g and g + 8) is its B (A) fragment for two
// k-steps. Lane (g, q) ends with row g's columns 2q, 2q + 1 in d[.][0..1] and row g + 8's in d[.][2..3].
__device__ __forceinline__ void mma16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// xrow: x row g at this lane's offset, K its row stride (row g + 8 is xrow + 8 K)
template <int XR, int CHUNKS>
__device__ __forceinline__ void mma_dots(const unsigned char* wrow, const bf16_t* xrow, int K, int g, float (&d)[4][4]) {
  const uint4 z = make_uint4(0, 0, 0, 0);
  constexpr int UNROLL = XR > 8 && CHUNKS > 8 ? 2 : 8;  // 544 threads cap ptxas at 96 registers: with row g + 8 too, 8 chunks of 40 spill
#pragma unroll UNROLL
  for (int c = 0; c < CHUNKS; ++c) {
    const uint4 w = *(const uint4*)(wrow + c * 64);
    const uint4 x = g < XR ? *(const uint4*)(xrow + c * 32) : z;
    const uint4 x8 = XR > 8 && g + 8 < XR ? *(const uint4*)(xrow + 8 * K + c * 32) : z;
    mma16816(d[(2 * c) & 3], x.x, x8.x, x.y, x8.y, w.x, w.y);
    mma16816(d[(2 * c + 1) & 3], x.z, x8.z, x.w, x8.w, w.z, w.w);
  }
}

// a stage's products on the tensor cores for warp gw of the NW warps sharing its unit (a slice of K each)
template <int XR, int NW>
__device__ __forceinline__ void tc_stage(const unsigned char* stage, const bf16_t* xs, int p, int half, int gw, int lane, float (&d)[4][4]) {
  const int g = lane >> 2, q = lane & 3, xg = g < XR ? g : 0;
  const bf16_t* x3 = xs + xg * F + w2_start(half) + q * 8;
  if (p == 3 && w2_len(half) == W2K) {
    constexpr int C = W2K / 32 / NW;
    mma_dots<XR, C>(stage + q * 16 + g * W2K * 2 + gw * C * 64, x3 + gw * C * 32, F, g, d);
  } else if (p == 3) {
    constexpr int C = W2LAST / 32 / NW;
    mma_dots<XR, C>(stage + q * 16 + g * W2LAST * 2 + gw * C * 64, x3 + gw * C * 32, F, g, d);
  } else {
    constexpr int C = D / 32 / NW;
    mma_dots<XR, C>(stage + q * 16 + g * D * 2 + gw * C * 64, xs + xg * D + q * 8 + gw * C * 32, D, g, d);
  }
}

// stage n of the ring for warp gw of its unit's NW: wait for it to land, add its products to d (zeroed at a unit's
// first stage), give it back; st: the stamps of the phase's first unit, else null
template <int XR, int NW, int COPY>
__device__ __forceinline__ void take_stage(unsigned long long* full, unsigned long long* empty, const unsigned char* ring,
                                           const bf16_t* xs, int n, int p, int half, int gw, int lane, float (&d)[4][4],
                                           unsigned long long* st) {
  const int s = n % S;
  if (COPY < 2) wait_parity(saddr(&full[s]), (n / S) & 1);
  if (st) { st[6] = now(); st[8] = clock64(); }
  if (half == 0)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.f;
  if (COPY == 0 || COPY == 2) tc_stage<XR, NW>(ring + s * STAGE, xs, p, half, gw, lane, d);
  if (st) st[9] = clock64();
  __syncwarp();
  if (lane == 0 && COPY < 2) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(&empty[s])) : "memory");
}

// column 2q + i of row g (lane (g, q)) of a unit: its four accumulators summed
__device__ __forceinline__ float tc_sum(const float (&d)[4][4], int i) { return (d[0][i] + d[1][i]) + (d[2][i] + d[3][i]); }

// gate/up's unit: columns 0-3 are gate rows 4u.., 4-7 the same up rows, so lane (g, q + 2) holds (g, q)'s up. Lanes
// q < 2 turn their v into SiLU(gate) x up, row g's and row g + 8's, and say so.
__device__ __forceinline__ bool unit_ups(float (&v)[4]) {
  float u[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) u[i] = __shfl_down_sync(0xffffffffu, v[i], 2);
  if ((threadIdx.x & 3) >= 2) return false;
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = silu_up(v[i], u[i]);
  return true;
}

// FLAGS: 1 counts each unit with red.release instead of a fence and an atomic add; 2 skips x's staging (COPY 3 only)
template <int XR, int COPY, int BARRIERS, int FLAGS = 0>
__device__ void run_mma(const PArgs& a) {
  const Smem m = smem_layout<XR>();
  unsigned long long *full = m.full, *empty = m.empty;
  unsigned char* ring = m.ring;
  bf16_t* xs = m.xs;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sm = blockIdx.x, nsm = a.nsm, g = lane >> 2, q = lane & 3;
  // empty: the owning warp; COPY 3: no copies, no products (the grid's chain alone)
  if (producer_done<COPY >= 2 ? 2 : COPY, 0>(a, m, 1)) return;
  int n = 0;
  for (int l = 0; l < a.layers; ++l)
    for (int p = 0; p < 4; ++p) {
      const int K = p == 3 ? F : D;
      unsigned long long* st = stamps(a, l, p);
      counted_input<XR, 2>(a, l, p, BARRIERS, true, !(FLAGS & 2), xs, st);  // each of its units counted
      int mine = 0;
      float d[4][4];
      for (int u = sm; u < units(p); u += nsm, ++mine)
        for (int half = 0; half < (p == 3 ? W2P : 1); ++half, ++n) {
          if (mine % CW != warp) continue;
          take_stage<XR, 1, COPY>(full, empty, ring, xs, n, p, half, 0, lane, d, st && u == sm && half == 0 ? st : nullptr);
          if (p == 3 && half < W2P - 1) continue;
          float v[4] = {tc_sum(d, 0), tc_sum(d, 1), tc_sum(d, 2), tc_sum(d, 3)};
          const bool up = p == 2 && unit_ups(v);
#pragma unroll
          for (int h8 = 0; h8 < (XR > 8 ? 2 : 1); ++h8) {  // rows g and g + 8
            const int r = g + 8 * h8;
            if (r >= XR || (p == 2 && !up)) continue;
            bf16_t* out = p == 0 ? a.qkv + r * 3 * D : p == 1 ? a.h + r * D : p == 2 ? a.gu + r * F : a.x + r * D;
            const int col = p == 2 ? u * 4 + 2 * q : u * 8 + 2 * q;
            out[col] = to_bf16(v[2 * h8]);
            out[col + 1] = to_bf16(v[2 * h8 + 1]);
          }
          __syncwarp();
          if (lane == 0) {  // this unit's outputs are written: count it
            if (FLAGS & 1) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.counters + l * 4 + p) : "memory");
            else { __threadfence(); atomicAdd(a.counters + l * 4 + p, 1u); }
          }
        }
      if (st) { st[3] = now(); st[11] = clock64(); }
      consumers_sync();  // xs is rewritten by the next phase
      if (st) st[4] = now();
    }
}

// run_ll: each phase's output carries its own readiness, as NCCL's LL protocol does: every 8-byte store is two
// bf16 values and the flag of the phase that wrote them (4 l + p + 2; the first input 1), so a reader polls the
// values themselves: no fence, no count, one trip through L2 per phase boundary. A unit is shared by NW warps, each
// a slice of K, their partial products summed in warp order through shared memory. WAIT 0 does not poll (timing).
__device__ __forceinline__ void ll_store(uint2* p, unsigned data, unsigned flag) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(data), "r"(flag) : "memory");
}
__device__ __forceinline__ uint2 ll_load(const uint2* p) {
  uint2 v;
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}
// two flagged pairs in one 16-byte access, as NCCL's LL reads and writes them: {data, flag, data, flag}, each 8-byte
// half written whole
__device__ __forceinline__ void ll_store4(uint4* p, unsigned d0, unsigned d1, unsigned flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %2};" ::"l"(p), "r"(d0), "r"(flag), "r"(d1) : "memory");
}
__device__ __forceinline__ uint4 ll_load4(const uint4* p) {  // relaxed.gpu or weak .cg loads measured the same
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned pack(float lo_, float hi_) { return (unsigned)to_bf16(lo_) | ((unsigned)to_bf16(hi_) << 16); }

// EPI: row r's (< XR) rstd from the consumers' partial sums of squares red [CW][XR], the 16 in turn (as a tree across the
// warp's lanes, two shared loads a lane and a butterfly, EPI 2 took as long and EPI 4 0.6-0.8 us more)
template <int XR>
__device__ __forceinline__ float row_rstd(const float* red, float eps, int r) {
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < CW; ++w) t += red[w * XR + r];
  return rsqrtf(t / D + eps);
}
// EPI 2, 4: rows 0's and 1's, the same sums in one loop (two calls of row_rstd build EPI 2 at 96 registers, not the
// measured 94)
template <int XR>
__device__ __forceinline__ void rows_rstd(const float* red, float eps, float& r0, float& r1) {
  float t0 = 0.f, t1 = 0.f;
#pragma unroll
  for (int w = 0; w < CW; ++w) {
    t0 += red[w * XR];
    t1 += XR > 1 ? red[w * XR + 1] : 0.f;
  }
  r0 = rsqrtf(t0 / D + eps);
  r1 = rsqrtf(t1 / D + eps);
}
// EPI: the staged rows kept in res (the residual of the phase after next), then RMSNorm'd in place in decode_block's
// order: float32 statistics, x * rstd rounded, times the weight w, rounded
template <int XR>
__device__ void norm_rows(bf16_t* xs, bf16_t* res, const bf16_t* w, float* red, float eps) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned* x2 = (unsigned*)xs;
#pragma unroll 1
  for (int r = 0; r < XR; ++r) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < D / 2; i += 512) {
      const unsigned u = x2[r * D / 2 + i];
      ((unsigned*)res)[r * D / 2 + i] = u;
      ss += lo(u) * lo(u) + hi(u) * hi(u);
    }
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) red[warp * XR + r] = ss;
  }
  consumers_sync();
#pragma unroll 1
  for (int r = 0; r < XR; ++r) {
    const float rstd = row_rstd<XR>(red, eps, r);
    for (int i = threadIdx.x; i < D / 2; i += 512) {
      const unsigned u = x2[r * D / 2 + i], wu = ((const unsigned*)w)[i];
      x2[r * D / 2 + i] = pack(rb(lo(u) * rstd) * lo(wu), rb(hi(u) * rstd) * hi(wu));
    }
  }
  consumers_sync();
}

// run_ll's read of a phase's flagged input (K columns a row, `stride` pairs apart) into xs [XR][K]: POLL warps'
// threads each load up to 8 pairs at once, then poll each until its flag is `want` (WAIT 0: take them as they are)
template <int XR, int POLL, int WAIT>
__device__ __forceinline__ void read_ll8(const uint2* src, int K, int stride, unsigned want, bf16_t* xs) {
  constexpr int T = POLL * 32, PER = (XR * F / 2 + T - 1) / T < 8 ? (XR * F / 2 + T - 1) / T : 8;
  const int np = XR * K / 2;  // pairs
  const auto at = [&](int i) { return src + (i / (K / 2)) * stride + i % (K / 2); };
  for (int base = threadIdx.x; base < np; base += PER * T) {
    uint2 v[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (base + j * T < np) v[j] = ll_load(at(base + j * T));
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = base + j * T;
      if (i >= np) break;
      while (WAIT && v[j].y != want) v[j] = ll_load(at(i));
      ((unsigned*)xs)[i] = v[j].x;
    }
  }
}
// the same in 16-byte pieces of two pairs; with `norm` (K = D), also the residual's copy into res and each row's
// sum of squares into ss (one template for both reads spilled EPI 2 at the 96-register cap)
template <int XR, int POLL, int WAIT, int SQ = 1>
__device__ __forceinline__ void read_ll16(const uint2* src, int K, int stride, unsigned want, bf16_t* xs, bool norm,
                                          bf16_t* res, float (&ss)[XR]) {
  constexpr int T = POLL * 32, PER = (XR * F / 4 + T - 1) / T < 8 ? (XR * F / 4 + T - 1) / T : 8;
  const int nq = XR * K / 4;  // pieces
  const auto at = [&](int i) { return (const uint4*)src + (i / (K / 4)) * (stride / 2) + i % (K / 4); };
  for (int base = threadIdx.x; base < nq; base += PER * T) {
    uint4 v[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (base + j * T < nq) v[j] = ll_load4(at(base + j * T));
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = base + j * T;
      if (i >= nq) break;
      while (WAIT && (v[j].y != want || v[j].w != want)) v[j] = ll_load4(at(i));
      ((uint2*)xs)[i] = make_uint2(v[j].x, v[j].z);
      if (norm) {
        ((uint2*)res)[i] = make_uint2(v[j].x, v[j].z);
        if (!SQ) continue;
        const float sq = lo(v[j].x) * lo(v[j].x) + hi(v[j].x) * hi(v[j].x) + lo(v[j].z) * lo(v[j].z) + hi(v[j].z) * hi(v[j].z);
#pragma unroll
        for (int r = 0; r < XR; ++r) ss[r] += r == i / (D / 4) ? sq : 0.f;  // (an index spills)
      }
    }
  }
}
// EPI 2: each thread RMSNorms the (at most two) pieces of xs it read, with the weights wv it loaded before the wait,
// with rows 0's and 1's rstd r0, r1; decode_block's rounding order
template <int XR>
__device__ __forceinline__ void norm_pieces(bf16_t* xs, const uint2 (&wv)[2], float r0, float r1) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = threadIdx.x + j * 512;
    if (i >= XR * D / 4) continue;
    const float rs = i / (D / 4) ? r1 : r0;
    const uint2 xv = ((const uint2*)xs)[i];
    ((uint2*)xs)[i] = make_uint2(pack(rb(lo(xv.x) * rs) * lo(wv[j].x), rb(hi(xv.x) * rs) * hi(wv[j].x)),
                                 pack(rb(lo(xv.y) * rs) * lo(wv[j].y), rb(hi(xv.y) * rs) * hi(wv[j].y)));
  }
}

// EPI 3: the rows' rstd from the 160 units' flagged sums of squares, read by every warp (5 per lane, from its own copy:
// one copy for all, 44df5c5, took 26.2-26.9 us per block against EPI 2's 20.6-20.8) and added in one
// fixed order (each lane's in turn, then a butterfly: every lane of every SM ends with the same bits), so no
// barrier of the consumers is needed for the statistics
template <int XR>
__device__ __forceinline__ void rstd_ll(const uint4* sq, unsigned want, float eps, float (&rs)[2]) {
  constexpr int N = D / 8 / 32;
  const int lane = threadIdx.x & 31;
  uint4 v[N];
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = ll_load4(sq + lane + 32 * j);
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    while (v[j].y != want || v[j].w != want) v[j] = ll_load4(sq + lane + 32 * j);
    s0 += __uint_as_float(v[j].x);
    s1 += __uint_as_float(v[j].z);
  }
  for (int o = 16; o; o >>= 1) {
    s0 += __shfl_xor_sync(0xffffffffu, s0, o);
    s1 += __shfl_xor_sync(0xffffffffu, s1, o);
  }
  rs[0] = rsqrtf(s0 / D + eps);
  rs[1] = XR > 1 ? rsqrtf(s1 / D + eps) : 0.f;
}

// POLL: the warps that read the phase's input. CNT 1: plain bf16 outputs, each unit counted with red.release, the
// readers waiting for the count (no flags: at 16 rows the flagged input, twice the bytes, is read whole by every
// SM). DBG (timing only, results wrong): 1 no sum of the group's partials (its other warps move on at once), 2 no
// stores, 4 (with WAIT 0) only every fourth SM reads the input (fewer requests for each of its L2 lines), 8 (EPI) the
// input read without the residual's copy or the squares, 16 (EPI) without the squares, 32 (results right) each
// SM's end of each phase stamped (ends), 64 (EPI) no keys or values written, 128 (EPI) no RoPE or residual adds,
// 256 (EPI 2, 4) no sums of the squares across threads, 512 (EPI 2-5) the RoPE table not staged, 1024 (EPI 2, 4, 5)
// no butterfly of a warp's sums before the consumers' barrier (the rstd then from stale sums).
// L16 1: the flagged values read and written two pairs (16 bytes) at a time, as NCCL's LL does (the fastest: 16.6 us per
// block with STAGES=5, 16.8-17.1 with 7). EPI 1 (with L16, up to 8 rows): the block's other work too, as decode_block's
// kernels do it: RMSNorm before qkv and gate/up, RoPE on q and k, k and v written out (the caches), the residual adds
// after wo and w2 (wo still reads q, where the model reads the attention's output); the norms' weights and the RoPE
// table read after each wait (22.0 us per block). EPI 2 (up to 2 rows): the same work, the weights loaded before the
// wait, the sums of squares taken while the input is read, the table in shared memory (20.0-20.9 us, a tie with
// decode_block's kernels; the norms' statistics across threads cost ~2 us of it, DBG 256, the keys' and values'
// stores ~0.8, DBG 64). EPI 3 (up to 2 rows): EPI 2 with the statistics published by the units that write a norm's
// input (wo's and w2's: each unit's rows' sums of squares, flagged) and read by every warp beside its pieces
// (rstd_ll), so a norm adds no barrier of the consumers; its sum's order is not decode_block's (22.8-23.0 us). EPI 4
// (up to 2 rows): the norms' weights folded into qkv's and gate/up's weights (the probe passes W * w rounded), x
// multiplied raw and each product scaled by its row's rstd before it is rounded, so the statistics are only needed at
// the units' ends: no normalising pass and no barrier for it, but not the model's roundings (rb(x * rstd) * w before
// the product there; 20.2-20.8 us). EPI 5: EPI 4 with the rstd added up only by the warps that store, at their first
// store (20.3-20.6 us). Measured and removed
// (docs/PERF_NOTES.md, "The persistent chain taken further"; the code at 50c908a): L2 prefetch while the ring is
// full, poll back-off, relaxed flags, a per-SM read order, per-warp-pair K-slices.
template <int XR, int NW, int COPY, int WAIT, int POLL = CW, int CNT = 0, int DBG = 0, int L16 = 0, int EPI = 0>
__device__ void run_ll(const PArgs& a) {
  constexpr int G = CW / NW;  // groups of NW warps, taking this SM's units in turn
  static_assert(!EPI || (L16 && !CNT && XR <= 8 && (EPI == 1 || (XR <= 2 && POLL == CW))),
                "EPI: 16-byte flagged values, up to 8 rows (2-5: up to 2, every consumer reading)");
  const Smem m = smem_layout<XR>();
  unsigned long long *full = m.full, *empty = m.empty;
  unsigned char* ring = m.ring;
  bf16_t* xs = m.xs;
  float* exch = m.exch;  // [G][2 units][NW][LN lanes holding rows][V values]
  constexpr int LN = 4 * XR < 32 ? 4 * XR : 32, V = XR > 8 ? 4 : 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sm = blockIdx.x, nsm = a.nsm, g = lane >> 2, q = lane & 3;
  const int group = warp / NW, gw = warp % NW;
  init_ring(full, empty, NW);  // empty: the group's warps (producer_done here spills run_ll<16, 8, 0, 1> at 96 registers)
  if (warp == CW) {
    produce<COPY == 3 ? 2 : COPY, 0>(a, full, empty, ring, sm, nsm, lane);
    return;
  }
  if (COPY == 4) return;  // the producer alone, waiting for its own copies to land (as bulk_stream.cu, in this order)
  if (EPI >= 2 && !(DBG & 512)) {
    for (int i = threadIdx.x; i < HD; i += 512) m.rope[i] = a.freqs[i];
    consumers_sync();
  }
  const float* rope_table = EPI >= 2 && !(DBG & 512) ? m.rope : a.freqs;
  int n = 0;
  for (int l = 0; l < a.layers; ++l)
    for (int p = 0; p < 4; ++p) {
      const int K = p == 3 ? F : D;
      unsigned long long* st = stamps(a, l, p);
      if (st) { st[0] = st[5] = now(); st[12] = clock64(); }  // no barrier: the poll is part of x's staging
      // EPI 2, a norm's phase: this thread's weights for the (at most two) pieces it reads, loaded before the wait
      const bool norm2 = EPI >= 2 && (p == 0 || p == 2);
      uint2 wv[2] = {make_uint2(0, 0), make_uint2(0, 0)};
      float ss[XR];
#pragma unroll
      for (int r = 0; r < XR; ++r) ss[r] = 0.f;
      if (norm2 && EPI < 4)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (threadIdx.x + j * 512 < XR * D / 4)
            wv[j] = __ldg((const uint2*)(a.nw + (l * 2 + p / 2) * D) + (threadIdx.x + j * 512) % (D / 4));
      const uint2* src = p == 0 ? a.xll : p == 1 ? a.qkvll : p == 2 ? a.hll : a.gull;
      const int stride = p == 1 ? 3 * D / 2 : K / 2;  // pairs per row of the input (wo reads qkv's first D)
      const unsigned want = 4 * l + p + 1;
      const int prev = l * 4 + p - 1;
      if (CNT && prev >= 0 && WAIT) wait_count(a, prev, units(prev % 4));
      if (CNT) stage_x<XR>(a, p, xs);
      const bool reads = !CNT && threadIdx.x < POLL * 32 && !((DBG & 4) && sm % 4);
      if (reads && L16)
        read_ll16<XR, POLL, WAIT, EPI != 3 && !(DBG & 16)>(src, K, stride, want, xs, norm2 && !(DBG & 8), m.res, ss);
      if (reads && !L16) read_ll8<XR, POLL, WAIT>(src, K, stride, want, xs);
      if (EPI == 3 && norm2) {  // the statistics from the units that wrote the input: this thread's pieces at once
        float rs[2];
        rstd_ll<XR>(a.sqll + ((p == 0 ? 0 : CW) + (threadIdx.x >> 5)) * (D / 8), want, a.eps, rs);
        norm_pieces<XR>(xs, wv, rs[0], rs[1]);
      }
      if ((EPI == 2 || EPI >= 4) && norm2 && !(DBG & (256 | 1024)))
#pragma unroll
        for (int r = 0; r < XR; ++r) {
          for (int o = 16; o; o >>= 1) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], o);
          if (lane == 0) m.red[warp * XR + r] = ss[r];
        }
      if (st) { st[1] = now(); st[13] = clock64(); }
      consumers_sync();
      if (EPI == 1 && (p == 0 || p == 2)) norm_rows<XR>(xs, m.res, a.nw + (l * 2 + p / 2) * D, m.red, a.eps);
      float rs0 = 0.f, rs1 = 0.f;  // EPI 2, 4: rows 0's and 1's rstd (EPI 4: for the products)
      if ((EPI == 2 || EPI == 4) && norm2 && !(DBG & 256)) rows_rstd<XR>(m.red, a.eps, rs0, rs1);
      if (EPI == 2 && norm2) {
        norm_pieces<XR>(xs, wv, rs0, rs1);
        consumers_sync();
      }
      if (st) { st[2] = now(); st[14] = clock64(); }
      int mine = 0;
      float d[4][4];
      for (int u = sm; u < units(p); u += nsm, ++mine)
        for (int half = 0; half < (p == 3 ? W2P : 1); ++half, ++n) {
          if (mine % G != group) continue;
          take_stage<XR, NW, COPY>(full, empty, ring, xs, n, p, half, gw, lane, d, st && u == sm && half == 0 ? st : nullptr);
          if (p == 3 && half < W2P - 1) continue;
          float v[4] = {tc_sum(d, 0), tc_sum(d, 1), tc_sum(d, 2), tc_sum(d, 3)};
          if (DBG & 1) {
            if (gw) continue;
          } else if (NW > 1) {  // the group's partials, summed in warp order by its first warp
            float* ex = exch + (group * 2 + (mine / G) % 2) * NW * LN * V;
            if (lane < LN)
#pragma unroll
              for (int i = 0; i < V; ++i) ex[(gw * LN + lane) * V + i] = v[i];
            asm volatile("bar.sync %0, %1;" ::"r"(2 + group), "r"(NW * 32) : "memory");
            if (gw) continue;
            if (lane < LN)
              for (int w = 1; w < NW; ++w)
#pragma unroll
                for (int i = 0; i < V; ++i) v[i] += ex[(w * LN + lane) * V + i];
          }
          const unsigned flag = 4 * l + p + 2;
          if (EPI >= 4 && (p == 0 || p == 2)) {  // the norm's rstd on the products of raw x and the folded weights
            if (EPI == 5 && mine < G)  // at the warp's first store: row g's alone (both rows' spill at 96 registers)
              rs0 = row_rstd<XR>(m.red, a.eps, g < XR ? g : 0);
            const float rg = EPI == 5 ? rs0 : g ? rs1 : rs0;  // row g's (rows past XR are not stored)
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] *= rg;
          }
          const bool up = p == 2 && unit_ups(v);
#pragma unroll
          for (int h8 = 0; h8 < (XR > 8 ? 2 : 1); ++h8) {  // rows g and g + 8
            const int r = g + 8 * h8, col = u * 8 + 2 * q;  // col: qkv's, wo's and w2's (gate/up's pair is u * 2 + q)
            float e = v[2 * h8], o = v[2 * h8 + 1];
            if (EPI && p != 2) {  // the projection rounded, then RoPE (q, k) or the residual (wo, w2), in float32
              e = rb(e);
              o = rb(o);
              if (p == 0 && col < 2 * D && !(DBG & 128)) {
                const float c = rope_table[col % HD], sn = rope_table[col % HD + 1], e0 = e;
                e = e * c - o * sn;
                o = o * c + e0 * sn;
              }
              if ((p == 1 || p == 3) && r < XR && !(DBG & 128)) {
                const unsigned rr = ((const unsigned*)m.res)[(r * D + col) / 2];
                e += lo(rr);
                o += hi(rr);
              }
            }
            const unsigned pk = pack(e, o);
            const unsigned pk1 = L16 ? __shfl_down_sync(0xffffffffu, pk, 1) : 0u;  // lane q + 1's pair, the next one
            if (EPI == 3 && (p == 1 || p == 3)) {  // the unit's rows' sums of squares of its rounded outputs, flagged
              float sq = lo(pk) * lo(pk) + hi(pk) * hi(pk);
              sq += __shfl_xor_sync(0xffffffffu, sq, 1);
              sq += __shfl_xor_sync(0xffffffffu, sq, 2);
              const float sq0 = __shfl_sync(0xffffffffu, sq, 0), sq1 = __shfl_sync(0xffffffffu, sq, 4);  // rows 0, 1
              if (lane < CW)  // lane w's copy for the consumers' warp w: each L2 line asked for by one warp per SM
                ll_store4(a.sqll + ((p == 3 ? 0 : CW) + lane) * (D / 8) + u, __float_as_uint(sq0), __float_as_uint(sq1), flag);
            }
            if (r >= XR || (p == 2 && !up) || (DBG & 2)) continue;
            const int pair = p == 2 ? u * 2 + q : u * 4 + q;
            if (EPI && p == 0 && col >= D) {  // k and v: to the caches, not to the next phase
              if (!(DBG & 64)) ((unsigned*)((col < 2 * D ? a.kc : a.vc) + (l * XR + r) * D))[(col % D) / 2] = pk;
              continue;
            }
            if (CNT) {
              bf16_t* out = p == 0 ? a.qkv + r * 3 * D : p == 1 ? a.h + r * D : p == 2 ? a.gu + r * F : a.x + r * D;
              ((unsigned*)out)[pair] = pk;
              continue;
            }
            uint2* out = p == 0 ? a.qkvll + r * (3 * D / 2) : p == 1 ? a.hll + r * (D / 2) : p == 2 ? a.gull + r * (F / 2) : a.xll + r * (D / 2);
            if (L16 && (q & 1) == 0) ll_store4((uint4*)(out + pair), pk, pk1, flag);
            if (!L16) ll_store(out + pair, pk, flag);
          }
          if (CNT) {  // the unit's outputs are written: count it
            __syncwarp();
            if (lane == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.counters + l * 4 + p) : "memory");
          }
        }
      if (st) { st[3] = now(); st[11] = clock64(); }
      if (st) st[4] = now();
      consumers_sync();  // xs is rewritten by the next phase
      if ((DBG & 32) && threadIdx.x == 0) a.ends[(l * 4 + p) * nsm + sm] = now();  // every consumer's stores issued
    }
}
