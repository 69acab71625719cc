// bf16 helpers shared by smem_gemv.cu and smem_attention.cu: smem_gemv.cuda_source puts this file before each (NVRTC
// gets no include paths, and needs no headers).
typedef unsigned short bf16_t;

__device__ __forceinline__ unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi(unsigned u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ bf16_t to_bf16(float f) {  // round to nearest even (finite values)
  unsigned u = __float_as_uint(f);
  return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float round_bf16(float f) { return __uint_as_float((unsigned)to_bf16(f) << 16); }
__device__ __forceinline__ float from_bf16(bf16_t b) { return __uint_as_float((unsigned)b << 16); }

__device__ __forceinline__ void unpack(const uint4& t, float* f) {
  f[0] = lo(t.x); f[1] = hi(t.x); f[2] = lo(t.y); f[3] = hi(t.y);
  f[4] = lo(t.z); f[5] = hi(t.z); f[6] = lo(t.w); f[7] = hi(t.w);
}
