"""The sliding branch (docs/spec.md, "Sliding branch"): its GPU backends."""
