"""The training loop of GEM-ref and what it needs: its config, flags, report, optimizers, metrics,
checkpoints, input validation, FLOPs, the e2e bench, and its side of the parallel plan. See
runtime/__init__.py."""
