"""ddops: fleet ops for a small GPU fleet that trains and serves speculative-decoding LLMs."""

__version__ = "0.1.0"
