"""Attention rewrites: padded attention in a model's graph -> gemcompile's attention ops.

rewrite.py     AttentionRewritePass: finds each attention once (match.py, scores.py), proves its mask once
               (passes/masks/) and hands it to the kernel family that serves it, chosen in one place
family.py      AttentionFamily (what a family contributes) and the emission helpers the families share
block.py jagged.py gdpa.py   the kernel families: what each accepts and how it emits its op
kernels.py     what the kernels serve, read from lowering/ (the families' one lowering import)
rotary.py      RoPE applied to q and k, proven (the block family fuses it)
joint.py       the joint-graph pass for hand-written attention that reached AOTAutograd
relative_bias.py   relative-position bias gathers -> gemcompile::relative_bias

A new attention kernel is one more family module here (``accept`` + ``emit``, its limits in kernels.py),
its op in lowering/, and one entry in ``AttentionRewritePass.family_types`` with its case in
``AttentionRewritePass._prove``; a new kind of mask is one more case of passes/masks/classify.py.
"""
