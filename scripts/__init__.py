"""Tooling for the K3 DSpark ROCm patch stack (see README.md)."""
