"""Speculative decoding: draft proposers. Verification lives in runner/rejection_sampler.py."""
