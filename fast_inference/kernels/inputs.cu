// The cudagraph backend's step inputs in one kernel, as inputs_triton.py's Triton kernel: row r's embedding plus its
// first control row to x, its later control rows to picked, and (program 0) the position's RoPE row to freqs. A
// control row is the control list's row at idx = pos - cls_token_num + 1 times whether that is a control token (the
// model's multiply by 0 or 1, kept for its rounding and signed zeros). Compiled at run time (NVRTC) by inputs_cuda.py,
// after common.cuh.

struct Args {
  const long long* token;  // (batch,): row r takes token r % batch
  const long long* pos;    // the step's position
  const void* emb;         // (vocab, D)
  const void* controls;    // (lists, >= R, Nc, D), strides below (elements)
  const float* table;      // the RoPE table, (positions, F) float32
  void* x;                 // (R, D)
  float* freqs;            // (F,)
  void* picked;            // (lists - 1, R, D)
  long long sl, sr, sn;    // controls' strides
  int batch, n_controls, cls_token_num, D, F, lists;
};

static_assert(sizeof(Args) == 112, "inputs_cuda.py's ctypes Args mirrors this layout");

#define MAX_LISTS 4  // control lists (model.NUM_CONTROL_LISTS is 3)

// program (r, j): row r's elements from j * blockDim.x on, one a thread, all its loads issued before its stores. (A
// store may alias a later load's buffer for all the compiler knows: a loop over a row's elements had each element's
// loads wait for the stores before them, an L2 round trip per element and list.)
template <int F32>
__device__ __forceinline__ void inputs(const Args& a) {
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous step's draw wrote the token and the position
  const int r = blockIdx.x, R = gridDim.x, d = blockIdx.y * blockDim.x + threadIdx.x;
  const long long pos = *a.pos, token = a.token[r % a.batch];
  if (d < a.D) {
    long long idx = pos - a.cls_token_num + 1;
    const float present = idx >= 0 && idx < a.n_controls ? 1.0f : 0.0f;
    idx = idx < 0 ? 0 : idx >= a.n_controls ? a.n_controls - 1 : idx;
    const long long row = r * a.sr + idx * a.sn + d;
    // control * present (exact: by 0 or 1, signed zeros kept), added to the embedding in float32 and rounded: the
    // model's ops
    float c[MAX_LISTS];
#pragma unroll
    for (int k = 0; k < MAX_LISTS; ++k) c[k] = k < a.lists ? load<F32>(a.controls, row + k * a.sl) * present : 0.f;
    const float e = load<F32>(a.emb, token * a.D + d);
    store<F32>(a.x, (long long)r * a.D + d, __fadd_rn(e, c[0]));
#pragma unroll
    for (int k = 1; k < MAX_LISTS; ++k)
      if (k < a.lists) store<F32>(a.picked, ((long long)(k - 1) * R + r) * a.D + d, c[k]);
  }
  // the RoPE row last: its store before the loads above would hold them back in this program
  if (r == 0 && blockIdx.y == 0)
    for (int f = threadIdx.x; f < a.F; f += blockDim.x) a.freqs[f] = a.table[pos * a.F + f];
}
