"""Checkpoints in and out: official safetensors, the tokenizer, upcycling a dense model."""
