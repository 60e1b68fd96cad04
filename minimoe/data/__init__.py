"""Benchmarks and your own multiple-choice data, as registered split manifests."""
