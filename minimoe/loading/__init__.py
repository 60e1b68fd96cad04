"""Checkpoints in and out: official safetensors, the tokenizer, gpt-oss's expert layout and MXFP4 blocks."""
