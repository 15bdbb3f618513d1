"""Block scoring and top-n selection (docs/spec.md, "Selection scores", "Choosing blocks") on the GPU."""
