"""Block scoring and top-n selection on the GPU (docs/spec.md, "Selection scores")."""
