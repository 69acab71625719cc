// How fast the SMs stream weights into shared memory with bulk copies, by stage size, ring depth and producer
// lanes, against plain 16-byte loads; every SM reads its own contiguous share. Measured by
// scripts/bulk_stream_probe.py (docs/PERF_NOTES.md, "A persistent chain of the projections").
__device__ __forceinline__ unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
template <int BYTES, int DEPTH, int PRODUCERS, int PIECES>
__device__ void stream(const unsigned char* src, long long per_sm) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned long long* full = (unsigned long long*)smem;  // [PRODUCERS][DEPTH]
  unsigned char* ring = smem + 1024;
  const int w = threadIdx.x >> 5;
  if (threadIdx.x & 31) return;
  for (int s = 0; s < DEPTH; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&full[w * DEPTH + s])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const unsigned char* base = src + blockIdx.x * per_sm;
  const long long n = per_sm / BYTES;
  long long i = 0;
  for (long long c = w; c < n; c += PRODUCERS, ++i) {
    const int s = i % DEPTH;
    const unsigned bar = saddr(&full[w * DEPTH + s]);
    if (i >= DEPTH) wait_parity(bar, ((i / DEPTH) - 1) & 1);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(BYTES) : "memory");
    const unsigned dst = saddr(ring + (w * DEPTH + s) * BYTES);
    for (int k = 0; k < PIECES; ++k)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(dst + k * (BYTES / PIECES)), "l"(base + c * BYTES + k * (BYTES / PIECES)), "r"(BYTES / PIECES), "r"(bar) : "memory");
  }
  for (int s = 0; s < DEPTH && s < i; ++s) {
    const long long last = i - 1 - ((i - 1 - s) % DEPTH);  // the last use of stage (last % DEPTH)
    wait_parity(saddr(&full[w * DEPTH + (last % DEPTH)]), (last / DEPTH) & 1);
  }
}
// plain 16-byte loads by every thread, folded into one word so that they are not dropped
__device__ void stream_ldg(const unsigned char* src, long long per_sm, unsigned* out) {
  const uint4* p = (const uint4*)(src + blockIdx.x * per_sm);
  const long long n = per_sm / 16;
  unsigned acc = 0;
#pragma unroll 8
  for (long long i = threadIdx.x; i < n; i += blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
