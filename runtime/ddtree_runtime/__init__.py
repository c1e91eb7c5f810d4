"""ddtree_runtime: lossless DDTree speculative decoding with a DFlash drafter, served over an OpenAI API."""

__version__ = "0.1.0"
