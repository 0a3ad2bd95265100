"""The op kit every op of lowering/ shares: the torch.library handle and dispatch rules (opkit.py), the
argument checks and what each kernel serves (checks.py), the plain-PyTorch helpers of the references
(reference.py), the attention FLOP conventions (flops.py), the Triton launch helper (tuned_launch.py), the
attention kernels' Triton toolkit (attention_triton.py, length_order_triton.py) and the jagged-layout
helpers (jagged.py)."""
