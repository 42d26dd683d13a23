"""Attention kernels over the paged KV array, each beside its jnp oracle in reference.py."""
