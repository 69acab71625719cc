"""Programmatic dependent launch (PDL, Hopper and later), shared by the decode kernels.

A kernel launched with PDL may start while the kernel before it drains. Until it calls
`pdl_wait`, it may only read memory that no kernel of the current step writes (weights, earlier
cache rows), and it writes nothing. After the wait, the previous kernel's writes are visible, and
the next kernel may launch.
"""
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


@functools.lru_cache
def use_pdl(device):
    """True where PDL exists: a CUDA device of compute capability 9 or later, outside the interpreter."""
    return (torch.device(device).type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch(pdl):
    """Launch arguments of a kernel with a PDL constexpr; launch_pdl only where it is used (Triton's
    interpreter knows no such option)."""
    return dict(PDL=pdl, **({"launch_pdl": True} if pdl else {}))


if triton is not None:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the previous kernel (its writes become visible), then let the next one launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
