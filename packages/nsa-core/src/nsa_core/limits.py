"""Bounds every part of nsa-core shares (docs/spec.md, "Symbols")."""

# Token positions are int32 in every kernel, so no sequence holds more than this many tokens.
MAX_TOKENS = 2**31 - 1
