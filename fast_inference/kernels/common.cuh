// Helpers shared by the CUDA C++ sources (bf16 values, bulk copies on an mbarrier): nvrtc.cuda_source puts this
// file before each (NVRTC gets no include paths, and needs no headers).
typedef unsigned short bf16_t;
#define NEG_INF __int_as_float(0xff800000u)  // no math.h under NVRTC

__device__ __forceinline__ unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi(unsigned u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ bf16_t to_bf16(float f) {  // round to nearest even (finite values)
  unsigned u = __float_as_uint(f);
  return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float round_bf16(float f) { return __uint_as_float((unsigned)to_bf16(f) << 16); }
__device__ __forceinline__ float from_bf16(bf16_t b) { return __uint_as_float((unsigned)b << 16); }

// element i of a float32 (F32) or bf16 buffer, as float; v stored rounded to the buffer's dtype
template <int F32>
__device__ __forceinline__ float load(const void* p, long long i) {
  return F32 ? ((const float*)p)[i] : from_bf16(((const bf16_t*)p)[i]);
}

template <int F32>
__device__ __forceinline__ void store(void* p, long long i, float v) {
  if (F32) ((float*)p)[i] = v;
  else ((bf16_t*)p)[i] = to_bf16(v);
}

// v reduced over the block by OP (0: max, 1: sum) through red (T / 32 words; T threads); every thread gets it
template <int T, int OP, typename V>
__device__ __forceinline__ V block_reduce(V v, V* red) {
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const V w = __shfl_xor_sync(0xffffffffu, v, o);
    v = OP ? v + w : (w > v ? w : v);
  }
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
#pragma unroll
  for (int w = 1; w < T / 32; ++w) v = OP ? v + red[w] : (red[w] > v ? red[w] : v);
  __syncthreads();  // red free again
  return v;
}

__device__ __forceinline__ void unpack(const uint4& t, float* f) {
  f[0] = lo(t.x); f[1] = hi(t.x); f[2] = lo(t.y); f[3] = hi(t.y);
  f[4] = lo(t.z); f[5] = hi(t.z); f[6] = lo(t.w); f[7] = hi(t.w);
}

// the pair (x0, x1) rotated by (c, s) as the eager RoPE rounds it: float32 products, then their sums (no FMA)
__device__ __forceinline__ float2 rotate(float x0, float x1, float c, float s) {
  return make_float2(__fadd_rn(__fmul_rn(x0, c), __fmul_rn(x1, -s)), __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}

// an asynchronous 16-byte copy from global src (through L2 only, as __ldcg) into shared dst; cp.async.wait_all then
// waits for all of this thread's copies
__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr(dst)), "l"(src) : "memory");
}

// the mbarrier at shared address bar, for one arrival (this thread's) that expects `bytes` of bulk copies
__device__ __forceinline__ void expect_bytes(unsigned bar, int bytes) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// a bulk copy of `bytes` from global src into shared dst, completing on the mbarrier bar
__device__ __forceinline__ void bulk(void* dst, const void* src, int bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(saddr(dst)), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// until the mbarrier bar's first phase has completed (all its bytes landed)
__device__ __forceinline__ void wait_phase0(unsigned bar) {
  unsigned done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar) : "memory");
}
