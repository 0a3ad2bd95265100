"""Attention masks, proven: the abstract interpreter of a mask's subgraph (evaluator.py), the terms a mask
formula is made of (terms.py), the one equivalence prover (prover.py), the one mask model (model.py) and
its classifier (classify.py), and the query-row mask a model applies after an attention (rows.py)."""
