"""Runnable simulations (debate, town, society) and the `tokendance` command line."""
