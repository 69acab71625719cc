"""For the interpreter scripts: the engine's plans with some of their JacobiPass fields forced (a kernel the plan takes
only on a CUDA GPU, run here under Triton's interpreter), while `forced` holds them; {} leaves the plan as made."""
import dataclasses

from fast_inference import engine, plan

make = plan.make
forced = {}  # JacobiPass fields set in every plan that runs passes, e.g. dict(verify="triton")


def with_forced(s):
    p = make(s)
    if p.jacobi is not None and forced:
        p = dataclasses.replace(p, jacobi=dataclasses.replace(p.jacobi, **forced))
    return p


engine.plans.make = with_forced
