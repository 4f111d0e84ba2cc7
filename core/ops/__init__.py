"""Device operations: the paged attention backends, Triton kernels, fused ops and rotary embeddings."""
