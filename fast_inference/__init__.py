"""ControlAR inference, fast: `from fast_inference import Pipeline` (pipeline.py), then `Pipeline()(...)` for images.

The names load on first use, so that importing a submodule (the reference's model, say) imports nothing else.
"""

__all__ = ["Pipeline", "PipelineConfig", "SamplingParams", "UserError"]


def __getattr__(name):
    if name in ("Pipeline", "PipelineConfig"):
        from fast_inference import pipeline

        return getattr(pipeline, name)
    if name in ("SamplingParams", "UserError"):
        from fast_inference import settings

        return getattr(settings, name)
    raise AttributeError(f"module 'fast_inference' has no attribute {name!r}")
