"""Tokenizer tier: chat templates and encoding on CPU hosts (no torch, no transformers)."""
