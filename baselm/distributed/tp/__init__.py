"""Tensor parallelism: every rank holds a slice of each layer (layers.py, moe.py), reads only its
bytes of the file (read.py, trace.py), and follows rank 0's step plans (plan.py, engine.py, persist.py)."""
