// The cudagraph backend's decode attention (one query per row and head, bf16 caches) under PDL: each program takes
// one slice of a (row, head)'s filled keys past the text prefix (tlen keys, zero: one partial, made after the
// prefill, that the merge adds), bulk-copies the slice's keys and values of earlier steps into shared
// memory before the PDL wait (no kernel of this step writes them), and after it reads the query and, in the slice that
// holds it, the step's key and value (the QKV kernel just before wrote them). Given them fresh (fk: the eager block's
// projection before RoPE), every program rotates the query, and the slice holding the position rotates the key and
// writes it and the value to the caches, as the model's rope_and_cache would in a kernel of its own. Its partial (max,
// sum, weighted values) goes to global memory; the (row, head)'s last program to finish merges them all. Compiled at
// run time (NVRTC) by attention_cuda.py, which names the instantiations, after common.cuh; no headers, so that NVRTC
// needs none. float32 arithmetic and one rounding, of the output, as attention_triton.py's Triton kernels.
// attend_loop, further down, is the form for many rows.

struct Args {
  const bf16_t* q;             // (R, H, HD) rows sq apart: the step's queries, rotated unless fresh
  bf16_t* kc;                  // the key cache, (rows, heads, positions, HD) by the strides below, rows HD apart
  bf16_t* vc;                  // the value cache, same strides
  const unsigned char* valid;  // key_valid (R, L) bool: which earlier keys a query may see
  const long long* pos;        // the position; its key and value are in the caches
  bf16_t* out;                 // (R, H, HD)
  float* part;                 // (R * H, splits, HD + 2): each program's (max, sum, weighted values)
  int* count;                  // (R * H,) programs done, zero between calls (the merging program re-zeroes it)
  long long sr, sh;            // cache strides in elements
  long long sv;                // key_valid's row stride
  int heads;
  int span;                    // keys a program's shared memory holds
  float scale;                 // softmax scale
  int tlen;                    // the text prefix's keys, one partial (tsum, tcount); the programs' keys start here
  const float* tsum;           // (R * H, HD): the text's attendable values summed (their scores are 0: zero keys)
  const float* tcount;         // (R,): how many there are
  const bf16_t* fk;            // fresh: the step's keys before RoPE, (R, H, HD) as q; null: in the caches already
  const bf16_t* fv;            // fresh: its values
  const float* freqs;          // fresh: the position's RoPE row, (HD / 2, 2) (cos, sin)
  long long sq;                // q's (and fk's, fv's) row stride in elements
};

static_assert(sizeof(Args) == 152, "attention_cuda.py's ctypes Args mirrors this layout");

// The text prefix's partial for thread tid < HD of (row, head) rh: max 0 (its keys are zero), sum tcount and
// weighted values tsum; max -inf (no weight) where none of its keys may be seen, or without one (tlen 0)
template <int HD>
__device__ __forceinline__ void text_partial(const Args& a, int rh, float& m, float& l, float& sum) {
  l = a.tlen ? a.tcount[rh / a.heads] : 0.f;
  m = l > 0.f ? 0.f : NEG_INF;
  sum = l > 0.f ? a.tsum[(long long)rh * HD + threadIdx.x] : 0.f;
}

// A program's slice of its (row, head)'s keys past the text (one partial), split of splits: keys s0 .. s0 + len - 1
// of the position's pos + 1; holds: the slice ends at the position (its key is the step's)
struct Slice {
  long long pos;
  int s0, len;
  bool holds;
};

__device__ __forceinline__ Slice slice_of(const Args& a, int split, int splits) {
  const long long pos = __ldcg(a.pos);  // the previous step wrote it
  const int n = (int)pos + 1 - a.tlen, per = (n + splits - 1) / splits;
  const int k0 = min(split * per, n), len = min(k0 + per, n) - k0;
  return Slice{pos, a.tlen + k0, len, len > 0 && k0 + len == n};
}

// Piece i's 8 dims f of a query or key rotated in place by the position's RoPE row (4 pairs), in float32
__device__ __forceinline__ void rotate8(const Args& a, int i, float* f) {
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    const float2 y = rotate(f[e], f[e + 1], a.freqs[i * 8 + e], a.freqs[i * 8 + e + 1]);
    f[e] = y.x, f[e + 1] = y.y;
  }
}

// Thread `piece`'s 8 dims of (row, head) rh's query, times the scale; fresh, rotated here first and rounded to bf16,
// as the model's RoPE rounds q
template <int HD>
__device__ __forceinline__ void query(const Args& a, int rh, int piece, float* qf) {
  unpack(__ldcg((const uint4*)(a.q + rh / a.heads * a.sq + rh % a.heads * HD) + piece), qf);
  if (a.fk) {
    rotate8(a, piece, qf);
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[e] = round_bf16(qf[e]);
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) qf[e] *= a.scale;
}

// Piece i (8 dims) of the step's key (or value) of (row, head) rh at pos: read from the cache, or fresh, the key
// rotated, both written to the caches
template <int HD>
__device__ __forceinline__ uint4 step_piece(const Args& a, int rh, long long pos, bool key, int i) {
  const int r = rh / a.heads, h = rh % a.heads;
  uint4* cache = (uint4*)((key ? a.kc : a.vc) + r * a.sr + h * a.sh + pos * HD) + i;
  if (!a.fk) return __ldcg(cache);
  uint4 t = __ldcg((const uint4*)((key ? a.fk : a.fv) + r * a.sq + h * HD) + i);
  if (key) {
    float f[8];
    unpack(t, f);
    rotate8(a, i, f);
    unsigned w[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) w[e / 2] = (unsigned)to_bf16(f[e]) | (unsigned)to_bf16(f[e + 1]) << 16;
    t = make_uint4(w[0], w[1], w[2], w[3]);
  }
  *cache = t;
  return t;
}

#define HELD 8  // partials the merge loads at once (GPT-XL 512 px: 8 slices a (row, head) up to 4 rows)

// The program's partial (max m, sum l and, in thread d < HD, the weighted values' sum for dim d) to the output when
// the (row, head) has one program (with the text's partial), else to `part`; the (row, head)'s last program to
// finish merges them all and the text's
template <int HD>
__device__ __forceinline__ void finish(const Args& a, int rh, int split, int splits, float m, float l, float sum,
                                       int* last) {
  const int tid = threadIdx.x;
  float tm, tl, ts;
  if (splits == 1) {
    if (tid >= HD) return;
    text_partial<HD>(a, rh, tm, tl, ts);
    if (tm == NEG_INF) {
      a.out[(long long)rh * HD + tid] = to_bf16(sum / l);
    } else {  // m is finite: the slice holds the position, whose key the query sees
      const float mx = fmaxf(m, tm), w = expf(m - mx), wt = expf(tm - mx);
      a.out[(long long)rh * HD + tid] = to_bf16(fmaf(w, sum, wt * ts) / fmaf(w, l, wt * tl));
    }
    return;
  }
  float* mine = a.part + ((long long)rh * splits + split) * (HD + 2);
  if (tid < HD) mine[2 + tid] = sum;
  if (tid == 0) mine[0] = m, mine[1] = l;
  __threadfence();  // the partial visible before the count says so
  __syncthreads();
  if (tid == 0) {
    *last = atomicAdd(a.count + rh, 1) == splits - 1;
    if (*last) a.count[rh] = 0;  // for the next call
  }
  __syncthreads();
  if (!*last || tid >= HD) return;
  __threadfence();
  const float* parts = a.part + (long long)rh * splits * (HD + 2);
  text_partial<HD>(a, rh, tm, tl, ts);
  // the first HELD partials loaded at once (unpredicated: past splits the last again, unused), the rest in turn: the
  // loops' loads had come in three batches, each after the one before had landed
  float pm[HELD], pl[HELD], ps[HELD];
#pragma unroll
  for (int s = 0; s < HELD; ++s) {
    const float* p = parts + min(s, splits - 1) * (HD + 2);
    pm[s] = __ldcg(p), pl[s] = __ldcg(p + 1), ps[s] = __ldcg(p + 2 + tid);
  }
  float mx = tm;  // finite after the loops: the slice holding the position sees its own key
#pragma unroll
  for (int s = 0; s < HELD; ++s) mx = s < splits ? fmaxf(mx, pm[s]) : mx;
  for (int s = HELD; s < splits; ++s) mx = fmaxf(mx, __ldcg(parts + s * (HD + 2)));
  float num = 0.f, den = 0.f;
  if (tm != NEG_INF) num = expf(tm - mx) * ts, den = expf(tm - mx) * tl;
#pragma unroll
  for (int s = 0; s < HELD; ++s)
    if (s < splits) {
      const float w = expf(pm[s] - mx);
      num = fmaf(w, ps[s], num), den = fmaf(w, pl[s], den);
    }
  for (int s = HELD; s < splits; ++s) {
    const float w = expf(__ldcg(parts + s * (HD + 2)) - mx);
    num = fmaf(w, __ldcg(parts + s * (HD + 2) + 2 + tid), num);
    den = fmaf(w, __ldcg(parts + s * (HD + 2) + 1), den);
  }
  a.out[(long long)rh * HD + tid] = to_bf16(num / den);
}

template <int HD, int NW, int PDL>
__device__ __forceinline__ void attend(const Args& a) {
  constexpr int T = NW * 32;
  constexpr int LANES = HD / 8;      // lanes per key in the scores, 8 dims (16 bytes) each
  constexpr int KEYS = T / LANES;    // keys scored at once
  static_assert(HD % 64 == 0 && LANES <= 32, "whole 16-byte pieces, groups within a warp");
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned long long* bar = (unsigned long long*)smem;
  int* last = (int*)(smem + 8);
  bf16_t* ks = (bf16_t*)(smem + 128);
  bf16_t* vs = ks + a.span * HD;
  float* sc = (float*)(vs + a.span * HD);  // the slice's scores, then its weights
  float* red = sc + a.span;                // NW * HD floats
  const int rh = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const int r = rh / a.heads, h = rh % a.heads, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const Slice slice = slice_of(a, split, splits);
  const long long pos = slice.pos;
  const int s0 = slice.s0, len = slice.len;  // this program's keys: s0 .. s0 + len - 1
  const bf16_t* krow = a.kc + r * a.sr + h * a.sh;
  const bf16_t* vrow = a.vc + r * a.sr + h * a.sh;
  const bool holds = slice.holds;
  const int early = holds ? len - 1 : len;  // keys of earlier steps, staged before the wait
  const unsigned b = saddr(bar);
  if (tid == 0 && early > 0) {
    expect_bytes(b, 2 * early * HD * 2);
    bulk(ks, krow + (long long)s0 * HD, early * HD * 2, b);
    bulk(vs, vrow + (long long)s0 * HD, early * HD * 2, b);
  }
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  if (holds && tid < 2 * LANES)  // this slice holds the position: its key and value
    ((uint4*)((tid < LANES ? ks : vs) + early * HD))[tid % LANES] =
        step_piece<HD>(a, rh, pos, tid < LANES, tid % LANES);
  const int g = tid / LANES, piece = tid % LANES;  // this thread's key in each pass, and its 8 dims of it
  float qf[8];
  query<HD>(a, rh, piece, qf);
  __syncthreads();  // the barrier's init and the position's row, seen by every thread
  if (early > 0) wait_phase0(b);

  const unsigned char* valid = a.valid + r * a.sv;
  for (int j0 = 0; j0 < len; j0 += KEYS) {  // every group of LANES threads a key: q . k, masked
    const int j = j0 + g;
    float s = 0.f;
    if (j < len) {
      float kf[8];
      unpack(((const uint4*)(ks + j * HD))[piece], kf);
#pragma unroll
      for (int e = 0; e < 8; ++e) s = fmaf(qf[e], kf[e], s);
    }
#pragma unroll
    for (int o = LANES / 2; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (j < len && piece == 0) sc[j] = s0 + j == pos || valid[s0 + j] ? s : NEG_INF;
  }
  __syncthreads();
  float m = NEG_INF;
  for (int j = tid; j < len; j += T) m = fmaxf(m, sc[j]);
  m = block_reduce<NW * 32, 0>(m, red);  // -inf for a slice of padding only, or none
  const float top = m == NEG_INF ? 0.f : m;
  float l = 0.f;
  for (int j = tid; j < len; j += T) {
    const float p = expf(sc[j] - top);
    sc[j] = p;
    l += p;
  }
  l = block_reduce<NW * 32, 1>(l, red);  // its barriers also show the weights to every thread

  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int j = g; j < len; j += KEYS) {  // as the scores: each group of LANES threads a key, 8 dims each
    const float p = sc[j];
    float vf[8];
    unpack(((const uint4*)(vs + j * HD))[piece], vf);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = fmaf(p, vf[e], acc[e]);
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {  // the warp's groups summed, then the warps' through shared memory
#pragma unroll
    for (int o = LANES; o < 32; o <<= 1) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
    if (lane < LANES) red[warp * HD + piece * 8 + e] = acc[e];
  }
  __syncthreads();
  float sum = 0.f;
  if (tid < HD)
#pragma unroll
    for (int w = 0; w < NW; ++w) sum += red[w * HD + tid];

  finish<HD>(a, rh, split, splits, m, l, sum, last);
}

// Past a few rows (the eager blocks past block_cuda's rows) the whole-slice staging above runs its programs in waves,
// each paying its copy's latency before its math. Here each program loops over its slice: LANES lanes per key, each
// group of them U keys a trip (loads in flight in registers, no staging, no barriers), with its own running max, sum
// and weighted values (online softmax); the program's groups merged through shared memory at the end, then finish.
// Trips are whole warps' (keys past the slice masked), so that every lane of a warp takes part in each shuffle.
template <int HD, int NW, int U>
__device__ __forceinline__ void attend_loop(const Args& a) {
  constexpr int LANES = HD / 8, PER_WARP = 32 / LANES, GROUPS = NW * PER_WARP;
  static_assert(HD % 64 == 0 && LANES <= 32, "whole 16-byte pieces, groups within a warp");
  extern __shared__ __align__(128) unsigned char smem[];
  int* last = (int*)smem;
  float* st = (float*)(smem + 128);  // GROUPS x (HD + 2): each group's (max, sum, weighted values)
  const int rh = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const int r = rh / a.heads, h = rh % a.heads, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int grp = lane / LANES, piece = lane % LANES;
  const Slice slice = slice_of(a, split, splits);
  const long long pos = slice.pos;
  const int s0 = slice.s0, len = slice.len;  // this program's keys: s0 .. s0 + len - 1
  const bf16_t* krow = a.kc + r * a.sr + h * a.sh + (long long)s0 * HD;
  const bf16_t* vrow = a.vc + r * a.sr + h * a.sh + (long long)s0 * HD;
  const unsigned char* valid = a.valid + r * a.sv + s0;
  float qf[8];
  query<HD>(a, rh, piece, qf);
  if (a.fk && slice.holds) {  // this slice holds the position: its key and value to the caches first
    if (tid < 2 * LANES) step_piece<HD>(a, rh, pos, tid < LANES, tid % LANES);
    __syncthreads();  // written before any thread loads them (from L2, as every key)
  }

  float m = NEG_INF, l = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int base = warp * PER_WARP * U; base < len; base += GROUPS * U) {
    const int j0 = base + grp * U;  // this group's keys j0 .. j0 + U - 1
    uint4 kt[U], vt[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // all loads first, in bounds (a key past the slice masked below)
      const long long j = min(j0 + u, len - 1);
      kt[u] = __ldcg((const uint4*)(krow + j * HD) + piece);
      vt[u] = __ldcg((const uint4*)(vrow + j * HD) + piece);
    }
    float s[U], mx = m;
#pragma unroll
    for (int u = 0; u < U; ++u) {  // q . k over the group's lanes, masked as model.attention_mask
      float kf[8], d = 0.f;
      unpack(kt[u], kf);
#pragma unroll
      for (int e = 0; e < 8; ++e) d = fmaf(qf[e], kf[e], d);
#pragma unroll
      for (int o = LANES / 2; o; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      const int j = j0 + u;
      s[u] = j < len && (s0 + j == pos || valid[j]) ? d : NEG_INF;
      mx = fmaxf(mx, s[u]);
    }
    if (mx != NEG_INF) {  // else nothing this group may see yet
      const float c = expf(m - mx);  // 0 while m is -inf
      l *= c;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= c;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = expf(s[u] - mx);
        float vf[8];
        unpack(vt[u], vf);
        l += p;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(p, vf[e], acc[e]);
      }
      m = mx;
    }
  }
  float* mine = st + (warp * PER_WARP + grp) * (HD + 2);
  if (piece == 0) mine[0] = m, mine[1] = l;
#pragma unroll
  for (int e = 0; e < 8; ++e) mine[2 + piece * 8 + e] = acc[e];
  __syncthreads();
  float top = NEG_INF, sum = 0.f, den = 0.f;
  for (int g = 0; g < GROUPS; ++g) top = fmaxf(top, st[g * (HD + 2)]);
  if (tid < HD && top != NEG_INF)  // -inf: a slice of padding only (or none); its partial weighs nothing
    for (int g = 0; g < GROUPS; ++g) {
      const float w = expf(st[g * (HD + 2)] - top);
      sum = fmaf(w, st[g * (HD + 2) + 2 + tid], sum);
      den = fmaf(w, st[g * (HD + 2) + 1], den);
    }
  finish<HD>(a, rh, split, splits, top, den, sum, last);
}

// attention_cuda.py appends a line per instantiation:
// extern "C" __global__ void __launch_bounds__(NW * 32) NAME(const Args a) { attend<HD, NW, PDL>(a); }
// or { attend_loop<HD, NW, U>(a); }
