"""gemcompile::gdpa: the op (op.py) with its flags in one value (spec.py), the plain-PyTorch reference,
Triton kernels (triton.py, bias_grad_triton.py, pairs_triton.py), the relative-position table it reads in
place (relative_table.py, diagonal_sums_triton.py) and the FLOP count."""
