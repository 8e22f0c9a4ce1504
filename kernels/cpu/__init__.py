"""The C++ CPU kernels (`*.cc`, with the shared headers `gemm.h` and `threads.h`), compiled on first
use into one library (`library`) and called through XLA's FFI."""
