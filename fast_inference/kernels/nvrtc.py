"""The CUDA C++ kernels' runtime: compiled at run time by NVRTC (which PyTorch's CUDA builds ship) and launched
through the driver's cuLaunchKernelEx, with PDL's attribute where asked, so that a CUDA graph captures them as it
captures Triton's. No Triton and no compiler at install time: the *_cuda.py modules name their instantiations, build
them here (`compiled`) and launch them (`launch`).
"""
import ctypes
import functools
import glob
import logging
import os
import sys
import threading

import torch

log = logging.getLogger("fast_inference")

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_SMEM = 227 * 1024  # shared memory a program may ask for on sm_90
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


class _AttrValue(ctypes.Union):  # CUlaunchAttributeValue
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


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


@functools.lru_cache
def _driver():
    return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")


def _check(r, what):
    if r:
        raise RuntimeError(f"nvrtc: {what} failed with error {r}")


def cuda_source(name):
    """The CUDA C++ of kernels/`name` after common.cuh's helpers (NVRTC gets no include paths)."""
    with open(os.path.join(HERE, "common.cuh")) as f, open(os.path.join(HERE, name)) as g:
        return f.read() + g.read()


def _cubin(src, arch, name):
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
        text = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, text)
        raise RuntimeError(f"{name}: NVRTC failed: {text.value.decode(errors='replace')}")
    size = ctypes.c_size_t()
    _check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
    cubin = ctypes.create_string_buffer(size.value)
    _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


def functions(src, arch, names, smem, file):
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


_kernels = {}  # (device index, kernel name) -> CUfunction, or None where it could not be built
_lock = threading.Lock()


def compiled(device, name, make_source, smem, file):
    """The CUfunction `name` of the CUDA C++ make_source() (from `file`) on device, allowed `smem` bytes of dynamic
    shared memory, compiled on first use and cached by device and name; None (logged once) if NVRTC or the driver
    refuses it (a GPU newer than this NVRTC knows, say)."""
    device = cuda_device(device)
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
                _kernels[key] = None
        return _kernels[key]


def available(device):
    """NVRTC and the driver's cuLaunchKernelEx on a CUDA device (the plan asks for sm_90+ on top)."""
    if cuda_device(device).type != "cuda":
        return False
    try:
        _nvrtc()
        return hasattr(_driver(), "cuLaunchKernelEx")
    except OSError:
        return False


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


def cuda_device(device):
    """torch.device(device), a CUDA one with its index ("cuda" alone: the current one), as kernels are built and cached
    per device index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def ptr(t):
    """A tensor's address for a kernel's Args (None for an unused pointer)."""
    return None if t is None else t.data_ptr()
