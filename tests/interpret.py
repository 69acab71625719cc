"""Triton's CPU interpreter for the test scripts: ENV runs a script under it (TRITON_INTERPRET=1, the repository and
tests/ on the path), and a script that imports this module first runs without the interpreter's re-patching per call.

For each kernel launch the interpreter patches the language modules its function sees (triton.language and
triton.language.core), scanning every member of them, and it does so again for each @triton.jit function the
kernel calls, although the kernel's patch still holds: a third of the fused kernels' interpreter time. Here a call
inside a running kernel patches only the language modules that the kernel's patch has not (Triton's own functions
see triton.language.core), and the kernel's end restores those too. Where Triton's interpreter has no such
functions (another version), or outside the interpreter, nothing changes. A scalar's index is read as later Triton
reads it (_patch_lang_of), so that Triton 3.6's interpreter runs the kernels' loops with runtime bounds too."""
import inspect
import os
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))

_patched = {}  # while a kernel runs: id of each language module patched -> its scope, in patch order


def _patch_once(fn):
    langs = {id(v): v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
    if _patched:  # called by the running kernel: what it patched holds until its end
        missing = {k: v for k, v in langs.items() if k not in _patched}
        if missing:
            _patched.update(dict.fromkeys(missing, _patch_lang_of(missing)))
        return interpreter._LangPatchScope()
    scope = _patch_lang_of(langs)
    _patched.update(dict.fromkeys(langs, scope))
    restore = scope.restore

    def restore_all():  # the calls' patches first (last in, first out), then the kernel's
        for s in reversed(list(dict.fromkeys(_patched.values()))):
            if s is not scope:
                s.restore()
        _patched.clear()
        restore()

    scope.restore = restore_all
    return scope


def _patch_lang_of(langs):
    scope = _patch_lang(types.SimpleNamespace(__globals__={str(k): v for k, v in langs.items()}))
    # A scalar's handle holds a one-element array; Triton 3.6 (the H200's) indexes it by int(array), which NumPy 2.4
    # refuses for arrays of one dimension (a loop's runtime bounds); later Triton squeezes it first, as here
    scope.set_attr(tl.core.tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    return scope


if os.environ.get("TRITON_INTERPRET") == "1":
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    _patch_lang = getattr(interpreter, "_patch_lang", None)
    if _patch_lang is not None and hasattr(interpreter, "_LangPatchScope"):
        interpreter._patch_lang = _patch_once
