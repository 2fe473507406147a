"""Adapters that run real models on kvblocks' paged KV cache.

Each adapter lives in its own module and imports its framework itself, so that ``import
kvblocks`` stays light: ``kvblocks.integrations.transformers`` needs ``kvblocks[transformers]``.
"""
