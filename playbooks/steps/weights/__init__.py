"""Making the weights: GGUF quants (F16, imatrix, KL divergence, manifests), EXL2 conversion, and
copying finished artifacts between hosts."""
