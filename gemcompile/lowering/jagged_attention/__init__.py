"""gemcompile::jagged_attention: the op (op.py), its plain-PyTorch reference, Triton kernels, FLOP count."""
