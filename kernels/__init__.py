"""Triton kernels, each beside the plain-torch reference that defines it."""
