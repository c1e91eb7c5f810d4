"""OpenAI-compatible HTTP server in front of one DDTree engine (``ddtree-serve``).

    ddtree-serve --target DIR --draft DIR [--mode ddtree|dflash|ar] [--port 8000] ...
    DDTREE_API_KEY=... ddtree-serve ...        # key from the environment, not the process list

Endpoints: GET /health (200 only once warmed up and while the engine thread lives; 503
starting/error/draining otherwise), GET /metrics (Prometheus text), GET /v1/models,
POST /v1/chat/completions and /v1/completions (streaming or not; a request's ``speculative``
object overrides mode and tree budget). With an API key set, /metrics needs it and /health shows a
caller without it only ``status``, ``mode`` and ``block_size`` (routes.PUBLIC_HEALTH).

Layout: ``cli`` parses flags into a ``ServerConfig``; ``app`` builds the FastAPI app; ``worker``
owns the engine on one thread and steps it for up to --max-running requests at once (continuous
batching), behind a bounded queue; ``generation`` turns engine rounds into text
for one request (``detok`` holds back partial characters and stop strings); ``routes`` speaks the
OpenAI wire format; ``schemas`` validates requests; ``metrics`` renders Prometheus text;
``draining`` makes SIGTERM finish in-flight work first.

Nothing here is test-only: the fault switch, the subprocess harness and the tiny models live in the
ddtree-devtools package (runtime/devtools), which the served wheel leaves out.
"""
