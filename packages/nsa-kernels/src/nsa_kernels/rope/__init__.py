"""Rotary position embedding on Triton (``apply_rope``): one pass over x, forward and backward."""
