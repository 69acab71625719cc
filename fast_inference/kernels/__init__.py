"""The decode kernels, one module per operation and implementation: <op>_triton.py, <op>_cuda.py (with <op>.cu, built
at run time by nvrtc.py). plan.py chooses which runs; the modules choose nothing themselves."""
