"""gemcompile::relative_bias: a relative-position bias gathered from a learned table (op.py)."""
