"""The 5D parallel plan (plan.py, pure) and its application under torch.distributed."""
