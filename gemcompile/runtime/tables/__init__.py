"""Embedding tables trained on their looked-up rows only: the SparseGrad modules (sparse_tables.py) and
SparseAdagrad (sparse_adagrad.py). Below runtime/distributed/ and runtime/training/, which both use them;
imports only lowering/."""
