"""The compressed branch (docs/spec.md, "Compressed branch"): its GPU backends."""
