"""gemcompile::block_attention: the op (op.py), its plain-PyTorch reference, Triton kernels and FLOP count."""
