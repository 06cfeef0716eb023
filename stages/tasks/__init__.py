"""Synthetic tasks with verifiable answers: prompts, tokenizer and supervised warm-up data."""
