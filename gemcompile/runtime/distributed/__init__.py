"""The 5D parallel plan (plan.py: pure, read by the sharding pass and explain) and its application under
torch.distributed (apply.py, with embedding.py, experts.py and collectives.py). See runtime/__init__.py."""
