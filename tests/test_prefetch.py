"""The prefetcher's fetch plans (prefetch.schedule): every projection weight once, each released by a count the
step reaches before that weight is read, none by a count the step never reaches (the step would wait forever)."""
from fast_inference import prefetch
from test_reference import tiny_model


def test_fused_schedule_fetches_each_weight_as_the_projection_before_starts():
    model = tiny_model()
    model.fuse_projections()
    plan = prefetch.schedule(model, compiled=False)
    assert [w for w, _ in plan] == prefetch.segments(model)
    # projection j starts as the count goes to j + 1: weight j is released by projection j - AHEAD's start
    assert [wait for _, wait in plan] == [max(0, j - prefetch.AHEAD + 1) for j in range(len(plan))]
    assert max(wait for _, wait in plan) <= 4 * len(model.layers)


def test_compiled_schedule_is_paced_by_each_layers_attention():
    model = tiny_model(n_layer=4)
    model.fuse_projections()
    plan = prefetch.schedule(model, compiled=True)
    weights = [w.data_ptr() for w, _ in plan]
    assert sorted(weights) == sorted(w.data_ptr() for w in prefetch.segments(model))  # each weight once
    for i, layer in enumerate(model.layers):
        wait = {w.data_ptr(): c for w, c in plan}
        # the attention of layer i is its (i + 1)-th count: it releases wo, gate/up and w2 of layer i, which the
        # step reads after it, and the next layer's qkv; the first qkv goes at once
        assert wait[layer.attention.wqkv.weight.data_ptr()] == i
        for w in (layer.attention.wo.weight, layer.feed_forward.w13, layer.feed_forward.w2.weight):
            assert wait[w.data_ptr()] == i + 1
    waits = [c for _, c in plan]
    assert waits == sorted(waits) and waits[-1] == len(model.layers)  # in order; the last count is the step's
