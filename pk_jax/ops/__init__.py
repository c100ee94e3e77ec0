"""The public ops, one module per op (file stem = the op's stem in ffi/ and cuda/kernels/)."""
