"""Benchmarks run through `s3serve bench`: engine vs HF generate, scheduling policies; trace replay and prompt pools."""
