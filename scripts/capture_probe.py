"""Which other CUDA graph capture takes inductor's PDL overlap from a captured chain (PERF_NOTES, "Inductor's
PDL and a second capture"). No engine: a chain of 12 RMSNorm + gate/up + SiLU + down + residual layers at 64
rows (GPT-XL widths, bf16), compiled by inductor with PDL, replayed 200 times. One CUDA GPU.

    python scripts/capture_probe.py mlp            # the chain is the process's only capture
    python scripts/capture_probe.py mlp,empty      # then torch.cuda.graph around nothing
    python scripts/capture_probe.py rawmlp,rawmlp  # two chains captured through the driver API

Items run in order; at the end every chain's graph is replayed and timed:
- `mlp` / `rawmlp`: the chain captured with torch.cuda.graph / with cuStreamBeginCapture (the caching
  allocator routed to a private pool meanwhile, as torch.cuda.graph does); `mlp36`, `rawmlp36`: of 36
  layers (the engine's n = 32 step, ~490 kernels, loses the gain to a second driver capture of itself);
- torch captures: `empty` (torch.cuda.graph around nothing), `elt` (x.add_(1)), `mm` (a 64 x 1280 x 1280
  matmul), `bare` (CUDAGraph.capture_begin/capture_end around x.add_(1) alone: no synchronize or
  empty_cache), `barekeep` (the same with keep_graph=True: never instantiated), `barekeepinst` (then
  instantiated), `sharedpool` (x.add_(1) into the first chain's pool);
- driver captures of x.add_(1) on a side stream: `rawnoinst` (never instantiated), `rawinst` (not launched),
  `raw` (relaxed mode), `rawg` (global mode), `rawf<N>` (instantiate flags N: 1 auto-free, 8 node
  priority), `rawpool` (global mode, flags 9, allocating, torch's allocator routed to a pool);
- `rtbare`: x.add_(1) captured through the runtime API (cudaStreamBeginCapture, global mode, as
  torch's capture_begin calls it, without torch's allocator steps), the graph destroyed uninstantiated;
- no capture: `mempool` (an allocation through torch.cuda.use_mem_pool), `hostempty` (the pinned-memory
  cache emptied, as torch.cuda.graph does), `eager` (the first chain run once without its graph).
"""
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference.engine import inductor_pdl

try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit("capture_probe.py needs a CUDA GPU and its driver (libcuda.so.1); run it on the GPU machine")
KEEP, POOLS, CHAINS, FNS = [], [], [], []


def check(result, call):
    assert result == 0, (call, result)


def replay_ms(graph, n=200):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


class RawGraph:
    def __init__(self, exe):
        self.exe = exe

    def replay(self):
        check(cuda.cuGraphLaunch(self.exe, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "launch")


def raw_capture(fn, stream, mode=0, flags=9, pool=True, instantiate=True):
    """fn() captured through the driver API on `stream`; the RawGraph (None if not instantiated)."""
    handle, graph, exe = ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(), ctypes.c_void_p()
    pool_id = torch.cuda.graph_pool_handle() if pool else None
    torch.cuda.synchronize()
    if pool:
        torch._C._cuda_beginAllocateToPool(0, pool_id)
    with torch.cuda.stream(stream):
        check(cuda.cuStreamBeginCapture_v2(handle, mode), "begin")
        out = fn()
        check(cuda.cuStreamEndCapture(handle, ctypes.byref(graph)), "end")
    if pool:
        torch._C._cuda_endAllocateToPool(0, pool_id)
    KEEP.append((out, graph, pool_id, stream))
    if not instantiate:
        return None
    check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, ctypes.c_ulonglong(flags)), "instantiate")
    return RawGraph(exe)


def chain_graph(raw, layers=12, rows=64, dim=1280, hidden=3584):
    inductor_pdl(torch.device("cuda"))
    with torch.device("cuda"):
        ws = [(torch.randn(2 * hidden, dim, dtype=torch.bfloat16) * 0.02, torch.randn(dim, hidden, dtype=torch.bfloat16)
               * 0.02) for _ in range(layers)]
        x = torch.randn(rows, dim, dtype=torch.bfloat16)

    def chain(x):
        for gate_up, down in ws:
            h = torch.nn.functional.rms_norm(x.float(), (dim,), eps=1e-5).to(x.dtype)
            g, u = (h @ gate_up.T).chunk(2, -1)
            x = x + (torch.nn.functional.silu(g) * u) @ down.T
        return x

    f = torch.compile(chain, fullgraph=True, dynamic=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            f(x)
    torch.cuda.current_stream().wait_stream(stream)
    FNS.append((f, x))
    KEEP.append(ws)
    if raw:
        graph = raw_capture(lambda: f(x), stream)
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            f(x)
        POOLS.append(graph.pool())
    graph.replay()
    return graph


def torch_capture(item):
    x = torch.zeros(1024, device="cuda")
    if item == "mm":  # the operands, and cuBLAS's handle and workspace, made before the capture
        a, w = (torch.randn(n, 1280, device="cuda", dtype=torch.bfloat16) for n in (64, 1280))
        a @ w
        KEEP.append((a, w))
    work = {"empty": lambda: None, "elt": lambda: x.add_(1), "mm": lambda: a @ w, "sharedpool": lambda: x.add_(1)}
    if item in work:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=POOLS[0] if item == "sharedpool" else None):
            work[item]()
    else:  # bare, barekeep, barekeepinst: capture_begin/capture_end alone
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=item != "bare")
        with torch.cuda.stream(stream):
            g.capture_begin()
            x.add_(1)
            g.capture_end()
        if item == "barekeepinst":
            g.instantiate()
        KEEP.append(stream)
    torch.cuda.synchronize()
    KEEP.append((g, x))


def runtime_capture():
    """x.add_(1) between cudaStreamBeginCapture and cudaStreamEndCapture of the CUDA runtime torch loaded."""
    torch.cuda.init()
    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line), None)
    if path is None:
        sys.exit("rtbare: this torch build has no shared libcudart loaded")
    cudart = ctypes.CDLL(path)
    x = torch.ones(1 << 16, device="cuda")
    stream, graph = torch.cuda.Stream(), ctypes.c_void_p()
    torch.cuda.synchronize()
    handle = ctypes.c_void_p(stream.cuda_stream)
    with torch.cuda.stream(stream):
        check(cudart.cudaStreamBeginCapture(handle, 0), "begin")
        x.add_(1)
        check(cudart.cudaStreamEndCapture(handle, ctypes.byref(graph)), "end")
    check(cudart.cudaGraphDestroy(graph), "destroy")
    torch.cuda.synchronize()
    KEEP.append((x, stream))


def raw_add(item):
    x = torch.ones(1 << 16, device="cuda")
    stream = torch.cuda.Stream()
    if item == "rawpool":
        graph = raw_capture(lambda: x * 2, stream)
    else:
        mode = 0 if item == "rawg" else 2
        flags = int(item[4:]) if item.startswith("rawf") else 0
        graph = raw_capture(lambda: x.add_(1), stream, mode, flags, pool=False, instantiate=item != "rawnoinst")
    if graph is not None and item != "rawinst":
        with torch.cuda.stream(stream):
            graph.replay()
        KEEP.append(graph)
    torch.cuda.synchronize()
    KEEP.append(x)


def main():
    items = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mlp"]
    for item in items:
        name = item.rstrip("0123456789")
        if name in ("mlp", "rawmlp"):  # mlp36: a chain of 36 layers
            layers = int(item[len(name):] or 12)
            CHAINS.append(chain_graph(raw=name == "rawmlp", layers=layers))
            print(f"chain {len(CHAINS)} ({item}) at once: {replay_ms(CHAINS[-1]):.4f} ms", flush=True)
        elif item.startswith("raw"):
            raw_add(item)
        elif item == "rtbare":
            runtime_capture()
        elif item == "mempool":
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool):
                KEEP.append((pool, torch.empty(1 << 20, device="cuda")))
        elif item == "hostempty":
            torch._C._host_emptyCache()
        elif item == "eager":
            f, x = FNS[0]
            f(x)
        else:
            torch_capture(item)
    print(f"{','.join(items)}: chains replayed at the end: {' / '.join(f'{replay_ms(g):.4f}' for g in CHAINS)} ms")


if __name__ == "__main__":
    main()
