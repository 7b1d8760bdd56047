"""Verification harness tests (see harness/__init__.py)."""
