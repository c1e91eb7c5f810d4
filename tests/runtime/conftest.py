"""Runtime tests share the tiny-model fixtures of tests/conftest.py (`tiny_models`, `tiny_hybrid_models`)."""
