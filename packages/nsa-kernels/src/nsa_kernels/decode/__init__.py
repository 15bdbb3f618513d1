"""One NSA decode step on the GPU: a batch of sequences, one query token each."""
