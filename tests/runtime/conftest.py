"""Runtime tests share the tiny-model fixtures of ``tests/conftest.py``."""
