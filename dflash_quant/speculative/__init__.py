"""Speculative decoding: the greedy/sampled decode loop (one request or a batch), the lookup proposer, the
target's cache, and the parity check built on them (with its cache of reusable runs)."""
