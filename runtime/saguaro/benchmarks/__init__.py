"""Benchmarks: nothing in the product imports them."""
