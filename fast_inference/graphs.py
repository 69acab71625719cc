"""CUDA graphs captured by hand: a key -> graph cache whose graphs (a shape's steps, its prefill, the condition
encoder's prepare) share one memory pool, and the state a capture's warm-up puts back.

One pool is safe here because the graphs never run at once and each one's outputs are read before the next one runs:
prepare's are copied into the shape's buffers, the prefill's logits drawn from before the first step, and the steps
write only buffers allocated outside any graph.
"""
import gc

import torch

def snapshot(state):
    """The buffers state.STATE names (what a run of the captured function changes besides the caches, which a rerun
    rewrites with the same values) and the RNG; state None: nothing."""
    if state is None:
        return None
    device = state.out.device
    rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return {name: getattr(state, name).clone() for name in state.STATE}, rng


def restore(state, saved):
    if saved is None:
        return
    buffers, rng = saved
    for name in state.STATE:
        getattr(state, name).copy_(buffers[name])
    if state.out.is_cuda:
        torch.cuda.set_rng_state(rng, state.out.device)
    else:
        torch.set_rng_state(rng)


class Graphs:
    """CUDA graphs by key, captured into one memory pool."""

    def __init__(self):
        self.graphs = {}
        self.pool = None

    def __contains__(self, key):
        return key in self.graphs

    def replay(self, key):
        self.graphs[key].replay()

    def drop(self, key):
        self.graphs.pop(key, None)

    def capture(self, key, fn, state=None):
        """Capture fn() as graph `key`: two warm-up runs on a side stream first, then the capture, then one replay
        (fn's work done once, as a plain call would), state's buffers (snapshot) put back before each (None: none)."""
        saved = snapshot(state)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                restore(state, saved)
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        restore(state, saved)
        # A graph freed while another is captured invalidates the capture (its reset is not permitted then): collect
        # what is already unreachable now, not in the middle of the capture
        gc.collect()
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        restore(state, saved)
        graph.replay()
        self.graphs[key] = graph
        return graph
