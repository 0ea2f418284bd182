"""Compact LLaVA-architecture modules whose parameter names follow the llava-hf checkpoints."""
