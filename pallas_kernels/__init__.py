"""Pallas kernels for mtpjax: one package per kernel (kernel, wrapper, reference)."""
