"""Programmatic dependent launch (PDL, Hopper and later), shared by the decode kernels.

A kernel launched with PDL may start while the kernel before it drains. Until it calls `pdl_wait`, it
writes nothing, and it reads only memory that no kernel of the current step writes (weights, earlier cache
rows) or, where the kernel just before lets it launch only after its own wait (EARLY, LATE), what a kernel
two or more launches back wrote: that one has finished by then. Reads of what a kernel of this step
wrote go to L2 (.cg): L1 is not coherent, and no wait has refreshed it yet. After the wait, the writes of
every kernel before are visible (each finished only after its own wait). The next kernel may launch before
the wait (FIRST: it then loads its weights while this one does too), right after it (EARLY), or once the
results are computed (LATE, `pdl_trigger`); its own wait holds it until this kernel has finished. Where it exists
(sm_90+) and which mode each kernel takes is the plan's (plan.py).
"""
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


# When a PDL kernel lets the next one launch: right after its wait (the next one fetches its weights
# meanwhile), once its results are computed, before its stores (the next one's programs then take no
# SM resources from programs of this one still to run; as its programs exit was slower, docs/PERF_NOTES.md),
# or before its wait (the next one fetches its weights while this one waits too: plan.GEMV_PDL).
EARLY, LATE, FIRST = 1, 2, 3


def launch(pdl):
    """Launch arguments of a kernel with a PDL constexpr: pdl False, True (EARLY), LATE or FIRST; launch_pdl only
    where it is used (Triton's interpreter knows no such option)."""
    return dict(PDL=int(pdl), **({"launch_pdl": True} if pdl else {}))


if triton is not None:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the previous kernel (its writes become visible); EARLY: then let the next one launch; FIRST:
        let it launch before the wait (the loads issued before this call stay ahead of it)."""
        if PDL == 3:
            tl.extra.cuda.gdc_launch_dependents()
        if PDL:
            tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def pdl_trigger(PDL: tl.constexpr):
        """LATE: let the next kernel launch (call it once the results are computed, before the stores)."""
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
