"""Model building blocks; each dispatches to Triton kernels on CUDA and torch references on CPU."""
