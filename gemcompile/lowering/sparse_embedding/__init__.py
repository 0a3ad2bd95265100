"""gemcompile::sparse_embedding: table lookups whose backward hands the optimizer only the looked-up rows.

``op.py`` the lookup op (forward = nn.Embedding / nn.EmbeddingBag's own kernels) and the op its backward
runs, which files (ids, gradient rows) with ``pending.py``; ``adagrad.py`` the row-wise Adagrad update that
consumes them (``reference.py`` on the CPU, ``adagrad_triton.py`` on CUDA).
"""
