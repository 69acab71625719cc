"""decode_block's GEMV path (one token, <= 4 rows, bf16 weights, sm_90 and later) as CUDA C++ kernels whose weights
are staged in shared memory before the PDL wait (smem_gemv.cu).

Triton holds a GEMV's weights in registers, so only as many programs as the register file holds can load theirs
before the kernel before them has finished; shared memory holds more, and bulk copies fill it without registers.
The kernels are compiled at run time by NVRTC, which PyTorch's CUDA builds ship, and launched through the driver's
cuLaunchKernelEx with PDL's attribute, so that a CUDA graph captures them as it does Triton's. `_serves` says where
they run; elsewhere (no NVRTC, an older GPU, float32, int8 weights, FAST_SMEM_GEMV=0) decode_block's Triton kernels
do, which compute the same roundings. They need no Triton: on the cudagraph backend all four of a block's projections
run here (ALL, where builds_block says so), with smem_attention's kernel (or the model's SDPA) between them, and the
eager block elsewhere.
"""
import ctypes
import functools
import glob
import logging
import os
import sys
import threading

import torch

from fast_inference.pdl import EARLY, FIRST, use_pdl

log = logging.getLogger("fast_inference")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smem_gemv.cu")
# (warps, output columns per warp) per kernel, and how the next kernel launches: pdl.EARLY, after this one's wait
# (FIRST, before it, lost: n = 1 1.137 -> 1.184 ms/step with all four here). H200, `python scripts/engine_ab.py
# --batch-sizes 1 --process-per-setting` (docs/PERF_NOTES.md #67), gate/up alone: (4, 4) 0.921, (8, 4) 0.916, (4, 2)
# 0.939, (4, 7) 1.045 ms/step, against 0.940 with the Triton kernel. The others from a chain of the four alone
# (GPT-XL, 2 rows, 8 blocks' weights back to back): 17.7 us per block against 21.0 for the Triton GEMVs; wo and qkv
# then re-tiled in the cudagraph backend's step (the only one that runs them here; PERF_NOTES #74, #75, `python
# scripts/engine_ab.py --backend cudagraph --batch-sizes 1,2`), ms/step at n = 1 / 2: wo (2, 4) 1.204, 1.196 / 1.781,
# 1.761; (2, 2) 1.196, 1.195 / 1.719, 1.725; (4, 2) 1.196, 1.196 / 1.721, 1.725; then qkv (8, 2) 1.213, 1.205 / 1.731,
# 1.739; (4, 4) 1.142, 1.142 / 1.636, 1.633; (8, 4) 1.143, 1.142 / 1.640, 1.656; (2, 8) 1.131, 1.130 / 1.643, 1.639.
CONFIG = dict(qkv=(4, 4), wo=(2, 2), gate_up=(8, 4), w2=(4, 1))
PDL = EARLY
ENABLED = os.environ.get("FAST_SMEM_GEMV", "1") != "0"
# The projections that run here. In the model each of the others lost, alone (n = 1, ms/step against 0.940): qkv
# 1.113, wo 1.016, w2 1.017; all four 1.137. Alone, chained, each had gained (PERF_NOTES #67): next to the Triton
# kernels, which let the next kernel launch before their wait (FIRST), they lose that overlap. gate/up, the largest
# (18.4 MB of GPT-XL's 40.7 per block), gains: n = 1 0.940 -> 0.916, n = 2 1.440 -> 1.411 (at (4, 4)).
KERNELS = ("gate_up",)
# Where there is no Triton (the cudagraph backend) all four run here, against cuBLAS's GEMVs and the eager ops between
# them (engine: `decode_block.decode_block(..., kernels=ALL)` where `builds_block` says so).
ALL = ("qkv", "wo", "gate_up", "w2")
# There, between smem_attention's kernels (which let the next launch after their wait), at up to ALL_FIRST_ROWS rows
# the next kernel launches before this one's wait (FIRST): two kernels ahead stage their weights. H200, `python
# scripts/engine_ab.py --backend cudagraph --batch-sizes 1,2 "" "smem_gemv.PDL = pdl.FIRST"` (PERF_NOTES #70), ms/step:
# n = 1 (2 rows) 1.358 / 1.361 -> 1.294 / 1.305, n = 2 (4 rows) 1.879 / 1.874 -> 1.930 / 1.929, the same tokens.
ALL_FIRST_ROWS = 2
KINDS = dict(linear=0, linear_add=1, gate_up=2, qkv=3)  # smem_gemv.cu's EPI


class Args(ctypes.Structure):  # smem_gemv.cu's Args
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("w", "x", "norm", "res", "add", "out", "freqs", "pos", "kc", "vc", "progress")] + \
               [("sr", ctypes.c_longlong), ("sh", ctypes.c_longlong), ("sn", ctypes.c_longlong), ("n", ctypes.c_int),
                ("hd", ctypes.c_int), ("eps", ctypes.c_float)]


class _AttrValue(ctypes.Union):  # CUlaunchAttributeValue
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute
MAX_SMEM = 227 * 1024  # shared memory a program may ask for on sm_90


def _loadable(paths):
    """The first of `paths` that loads as a shared library, or None."""
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@functools.lru_cache
def _nvrtc():
    """PyTorch's NVRTC library: by its soname (loaded with torch, or on the library path), else from the nvidia
    packages beside torch (searched only then)."""
    major = torch.version.cuda.split(".")[0]
    names = [f"nvrtc64_{major}0_0.dll"] if sys.platform == "win32" else [f"libnvrtc.so.{major}", "libnvrtc.so"]
    packaged = lambda d: glob.glob(os.path.join(d, "nvidia", "**", f"libnvrtc.so.{major}*"), recursive=True)
    lib = _loadable(names) or _loadable(sorted(p for d in sys.path for p in packaged(d)))
    if lib is None:
        raise OSError("NVRTC not found")
    return lib


def _check(r, what):
    if r:
        raise RuntimeError(f"smem_gemv: {what} failed with error {r}")


def cuda_source(path):
    """The CUDA C++ of `path` after common.cuh's helpers (NVRTC gets no include paths)."""
    with open(os.path.join(os.path.dirname(SOURCE), "common.cuh")) as f, open(path) as g:
        return f.read() + g.read()


def source(names):
    """smem_gemv.cu with an entry point per (name, (kind, K, warps, columns per warp, rows, pdl)) in `names`."""
    return cuda_source(SOURCE) + "".join(
        f'extern "C" __global__ void __launch_bounds__({nw * 32}) {name}(const Args a) '
        f"{{ project<{kind}, {k}, {nw}, {rpw}, {xr}, {pdl}>(a); }}\n" for name, (kind, k, nw, rpw, xr, pdl) in names)


def _cubin(src, arch, name="smem_gemv.cu"):
    """A cubin of the CUDA C++ `src` for sm_<arch>, by NVRTC (name: the file its errors name)."""
    nvrtc = _nvrtc()
    prog = ctypes.c_void_p()
    _check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17"]
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    if r:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"{name}: NVRTC failed: {log.value.decode(errors='replace')}")
    size = ctypes.c_size_t()
    _check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
    cubin = ctypes.create_string_buffer(size.value)
    _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


def functions(src, arch, names, smem, file="smem_gemv.cu"):
    """{name: CUfunction} for the entry points `names` of the CUDA C++ `src` (from `file`), compiled for sm_<arch> and
    loaded into the current CUDA context, each allowed `smem` bytes of dynamic shared memory (also the probes'
    loader)."""
    cuda = _driver()
    module = ctypes.c_void_p()
    _check(cuda.cuModuleLoadData(ctypes.byref(module), _cubin(src, arch, file)), "cuModuleLoadData")
    out = {}
    for name in names:
        f = ctypes.c_void_p()
        _check(cuda.cuModuleGetFunction(ctypes.byref(f), module, name.encode()), "cuModuleGetFunction")
        _check(cuda.cuFuncSetAttribute(f, MAX_DYNAMIC_SHARED_SIZE_BYTES, smem), "cuFuncSetAttribute")
        out[name] = f
    return out


_kernels = {}  # (device index, kernel name) -> CUfunction
_lock = threading.Lock()


@functools.lru_cache
def _driver():
    return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")


def compiled(device, name, make_source, smem, file):
    """The CUfunction `name` of the CUDA C++ make_source() (from `file`) on device, allowed `smem` bytes of dynamic
    shared memory, compiled on first use and cached by device and name; None (logged) if NVRTC or the driver refuses
    it (a GPU newer than this NVRTC knows, say). Also smem_attention's."""
    key = (device.index, name)
    with _lock:
        if key not in _kernels:
            try:
                _driver()  # first: without a driver (a CPU machine) OSError, before torch.cuda is asked anything
                major, minor = torch.cuda.get_device_capability(device)
                torch.cuda.synchronize(device)  # its primary context made, and current on this thread below
                with torch.cuda.device(device):
                    _kernels[key] = functions(make_source(), f"{major}{minor}", [name], smem, file)[name]
            except (OSError, RuntimeError) as e:
                log.warning("%s", e)
                return None
        return _kernels[key]


def _kernel(device, entry):
    """The CUfunction of `entry` = (kind, K, warps, columns per warp, rows, pdl) on device (compiled); None if it
    cannot be built: then the device is marked unavailable, and decode_block's Triton kernels run from then on."""
    name = "smem_gemv_" + "_".join(map(str, entry))
    f = compiled(device, name, lambda: source([(name, entry)]), _smem(entry), "smem_gemv.cu")
    if f is None:
        log.warning("decode_block's Triton kernels run instead of smem_gemv's")
        _available[device.index] = False
    return f


def _entry(kind, name, k, rows, pdl, kernels=None):
    """The kernel of projection `name` (CONFIG's tiling) as `kind` (KINDS) over K = k at `rows` rows, launched with
    PDL's attribute if pdl, in PDL's mode for the projections `kernels` run here: the key _kernel builds and caches
    it by."""
    mode = FIRST if kernels == ALL and rows <= ALL_FIRST_ROWS else PDL
    return (KINDS[kind], k, *CONFIG[name], rows, mode if pdl else 0)


def _smem(entry):
    kind, k, nw, rpw, xr, _ = entry
    return 128 + nw * rpw * (2 if kind == KINDS["gate_up"] else 1) * k * 2 + xr * k * 2


def launch(f, grid, threads, smem, args, pdl, device):
    """Launch CUfunction f over `grid` programs of `threads` threads with its one argument, the ctypes struct args,
    on the current stream, with PDL's attribute if pdl (a CUDA graph captures it as any kernel)."""
    attr = _Attr(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.flag = 1
    config = _Config((*grid, *(1,) * (3 - len(grid))), (threads, 1, 1), smem,
                     torch.cuda.current_stream(device).cuda_stream, ctypes.pointer(attr) if pdl else None,
                     1 if pdl else 0)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
    _check(_driver().cuLaunchKernelEx(ctypes.byref(config), f, params, None), "cuLaunchKernelEx")


def _launch(entry, columns, args, device):
    """Launch `entry` over `columns` output columns, with PDL's attribute if it uses PDL; False where it could not be
    built."""
    f = _kernel(device, entry)
    if f is None:
        return False
    _, _, nw, rpw, _, pdl = entry
    launch(f, (columns // (nw * rpw),), nw * 32, _smem(entry), args, pdl, device)
    return True


_available = {}


def cuda_device(device):
    """torch.device(device), a CUDA one with its index ("cuda" alone: the current one), as kernels are built and cached
    per device index (also smem_attention's, cuda_draw's and cuda_inputs' `builds`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def available(device):
    """NVRTC and the driver's cuLaunchKernelEx here, and a GPU of compute capability 9.0 or later (bulk copies,
    PDL). Checked once per CUDA device, by its index ("cuda" alone: the current one); no other device has them."""
    device = cuda_device(device)
    if device.type != "cuda":
        return False
    index = device.index
    if index not in _available:
        ok = use_pdl(device)
        if ok:
            try:
                _nvrtc()
                ok = hasattr(_driver(), "cuLaunchKernelEx")
            except OSError:
                ok = False
        _available[index] = ok
    return _available[index]


def _runs(rows, dtype, device):
    """Whether these kernels run at all for `rows` rows of `dtype` on device: <= 4 rows, bf16, where available."""
    return ENABLED and rows <= 4 and dtype == torch.bfloat16 and available(device)


def _tiles(name, rows, k, columns):
    """Whether kernel `name` tiles x (rows, k) into `columns` output columns: K a multiple of 256, the columns a whole
    number of programs, and the weights and x within a program's shared memory (GPT-1B's gate/up, K = 2,048, would
    ask for 264 KB, which the driver refuses)."""
    nw, rpw = CONFIG[name]
    entry = _entry("gate_up" if name == "gate_up" else "linear", name, k, rows, False)
    return k % 256 == 0 and columns % (nw * rpw) == 0 and _smem(entry) <= MAX_SMEM


def _serves(name, x, columns, *tensors, scales=None, kernels=None):
    """Whether these kernels run projection `name` of x (R, K) into `columns` output columns: one of `kernels`
    (KERNELS if None) where they run (_runs), no row scales (int8), tiled (_tiles), every tensor bf16 and contiguous."""
    mine = KERNELS if kernels is None else kernels
    if name not in mine or scales is not None or not _runs(x.shape[0], x.dtype, x.device):
        return False
    return _tiles(name, *x.shape, columns) and all(t.dtype == torch.bfloat16 and t.is_contiguous()
                                                   for t in (x, *tensors))


def used(rows, dtype, device, layer, kernels=None):
    """The projections of `kernels` (KERNELS if None) these kernels run at `rows` rows of `dtype` on device in blocks
    shaped as `layer`, a fused TransformerBlock (for the engine's log)."""
    if not _runs(rows, dtype, device):
        return ()
    weights = dict(qkv=layer.attention.wqkv.weight, wo=layer.attention.wo.weight, gate_up=layer.feed_forward.w13,
                   w2=layer.feed_forward.w2.weight)
    columns = lambda name: weights[name].shape[0] // (2 if name == "gate_up" else 1)
    return tuple(name for name in (KERNELS if kernels is None else kernels)
                 if _tiles(name, rows, weights[name].shape[1], columns(name)))


def builds_block(layer, rows, device):
    """Whether every projection of blocks shaped as `layer` (fused gate/up, bf16 weights) runs here at each row count
    in `rows`: they tile, and their kernels build now, before any step is captured, so that a refusal leaves the
    eager block whole rather than a step half made of these kernels (the cudagraph backend, which has no Triton to
    fall back on)."""
    attn, ff = layer.attention, layer.feed_forward
    weights = (attn.wqkv.weight, attn.wo.weight, ff.w13, ff.w2.weight)
    if ff.w13 is None or any(w.dtype != torch.bfloat16 for w in weights) or attn.head_dim % CONFIG["qkv"][1]:
        return False
    D, F = attn.wo.weight.shape[0], ff.w2.weight.shape[1]
    for r in rows:
        if used(r, torch.bfloat16, device, layer, ALL) != ALL:
            return False
        entries = [_entry("qkv", "qkv", D, r, True, ALL), _entry("linear", "wo", D, r, True, ALL),
                   _entry("gate_up", "gate_up", D, r, True, ALL), _entry("linear", "w2", F, r, True, ALL),
                   _entry("linear_add", "w2", F, r, True, ALL)]  # w2 with the control rows, before blocks L, 2L
        if any(_kernel(cuda_device(device), e) is None for e in entries):
            return False
    return True


def _ptr(t):
    return None if t is None else t.data_ptr()


def linear(x, weight, scales, residual, name, pdl, then=None, progress=None, kernels=None):
    """residual + x @ weight.T (+ then), as decode_block.linear; None where these kernels do not serve it (_serves,
    or no residual) or it could not be built."""
    R, K = x.shape
    N = weight.shape[0]
    if residual is None or not _serves(name, x, N, weight, scales=scales, kernels=kernels):
        return None
    out = torch.empty(R, N, device=x.device, dtype=x.dtype)
    args = Args(w=_ptr(weight), x=_ptr(x), res=_ptr(residual), add=_ptr(then), out=_ptr(out), progress=_ptr(progress),
                n=N)
    entry = _entry("linear" if then is None else "linear_add", name, K, R, pdl, kernels)
    return out if _launch(entry, N, args, x.device) else None


def gate_up(x, norm, w13, scales, pdl, progress=None, kernels=None):
    """SiLU(g) * u for [g | u] = RMSNorm(x) @ w13.T, as decode_block.gate_up; None where these kernels do not serve
    it or it could not be built."""
    R, K = x.shape
    F = w13.shape[0] // 2
    if not _serves("gate_up", x, F, w13, norm.weight, scales=scales, kernels=kernels):
        return None
    out = torch.empty(R, F, device=x.device, dtype=x.dtype)
    args = Args(w=_ptr(w13), x=_ptr(x), norm=_ptr(norm.weight), out=_ptr(out), progress=_ptr(progress), n=F,
                eps=norm.eps)
    return out if _launch(_entry("gate_up", "gate_up", K, R, pdl, kernels), F, args, x.device) else None


def qkv_rope(x, norm, weight, scales, freqs, input_pos, k_cache, v_cache, n_head, pdl, progress=None, kernels=None):
    """q (R, H, 1, hd), k and v written into the caches at input_pos, as decode_block.qkv_rope; None where these
    kernels do not serve it (or the RoPE row is not float32) or it could not be built."""
    R, D = x.shape
    hd = D // n_head
    rpw = CONFIG["qkv"][1]
    if (not _serves("qkv", x, 3 * D, weight, norm.weight, scales=scales, kernels=kernels) or hd % rpw
            or freqs.dtype != torch.float32 or input_pos.dtype != torch.int64):
        return None
    q = torch.empty(R, n_head, 1, hd, device=x.device, dtype=x.dtype)
    args = Args(w=_ptr(weight), x=_ptr(x), norm=_ptr(norm.weight), out=_ptr(q), freqs=_ptr(freqs),
                pos=_ptr(input_pos), kc=_ptr(k_cache), vc=_ptr(v_cache), progress=_ptr(progress),
                sr=k_cache.stride(0), sh=k_cache.stride(1), sn=k_cache.stride(2), n=3 * D, hd=hd, eps=norm.eps)
    return q if _launch(_entry("qkv", "qkv", D, R, pdl, kernels), 3 * D, args, x.device) else None
