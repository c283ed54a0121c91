"""Model weights: the generated tiny model (later: fetch, convert, quantize)."""
