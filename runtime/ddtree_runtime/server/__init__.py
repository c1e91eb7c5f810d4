"""OpenAI-compatible HTTP server in front of one DDTree engine.

Layout: ``cli`` parses flags into a ``ServerConfig``; ``app`` builds the FastAPI app; ``worker``
owns the engine on one thread behind a bounded queue; ``generation`` turns engine rounds into text
for one request; ``routes`` speaks the OpenAI wire format; ``schemas`` validates requests;
``metrics`` renders Prometheus text.
"""
