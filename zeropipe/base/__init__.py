"""The torch base: the one compatibility module for private or version-dependent torch
API (``_compat``), the compute device and its copy streams (``device``, the one module
that names "cuda"), and storage identity and byte counts (``storage``).
"""
