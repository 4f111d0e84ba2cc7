"""The kernel: requests, scheduling, KV-block accounting and the frame ledger. Pure Python, no torch."""
