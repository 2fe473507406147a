"""Torch tensor backends (CPU, CUDA, XPU) that allocate and move the real KV blocks.

Empty for now; the backends issue fills it. Nothing here may be imported by
``import kvblocks``: torch is loaded only when a backend is used.
"""
