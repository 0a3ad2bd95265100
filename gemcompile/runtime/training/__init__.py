"""The training loop of GEM-ref and what it reports: metrics, checkpoints, FLOPs, the e2e bench."""
