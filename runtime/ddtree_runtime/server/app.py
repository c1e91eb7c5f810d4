"""The FastAPI app: routes, OpenAI-style error handlers, request metrics, engine worker lifecycle."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ddtree_runtime.engine.api import ServedEngine
from ddtree_runtime.server.config import ServerConfig
from ddtree_runtime.server.context import ServerContext
from ddtree_runtime.server.errors import APIError, error_body
from ddtree_runtime.server.metrics import Metrics
from ddtree_runtime.server.openapi import OPENAPI_PATH, openapi_document
from ddtree_runtime.server.routes import CLIENT_CLOSED, router
from ddtree_runtime.server.worker import READY, EngineWorker

log = logging.getLogger("ddtree_runtime.server")

# Label values for request metrics; any other path is "other" (unbounded label values are a leak).
ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", OPENAPI_PATH)
UNCOUNTED_IN_FLIGHT = ("/health", "/metrics")


def create_app(config: ServerConfig, engine_factory: Callable[[ServerConfig], ServedEngine] | None = None) -> FastAPI:
    """Build the app. The engine loads on the worker thread once the app starts (lifespan), so the
    HTTP listener answers /health with ``starting`` while the model loads."""
    metrics = Metrics()
    worker = EngineWorker(config, metrics, engine_factory)
    ctx = ServerContext(config, worker, metrics)
    metrics.add_gauge("queue_depth", "Requests waiting for a free engine slot.", worker.queue_depth)
    metrics.add_gauge("engine_busy", "1 while the engine works on a request.", lambda: 1 if worker.working() else 0)
    metrics.add_gauge("running_requests", "Requests in the engine (decoding or prefilling).", worker.running)
    metrics.add_gauge("max_running_requests", "Requests the engine runs at once (--max-running, or what fit).",
                      worker.capacity)
    metrics.add_gauge("batch_size", "Requests verified together in the last round.",
                      lambda: worker.stats().batch_size)
    metrics.add_gauge("round_tree_nodes", "Tree nodes (roots included) verified in the last round, all requests.",
                      lambda: worker.stats().tree_nodes)
    metrics.add_gauge("round_tree_budget", "Tree budget of the last round (--tree-policy cost chooses it each round; "
                      "0: a plain AR round).", lambda: worker.stats().round_budget)
    metrics.add_gauge("round_predicted_tokens_per_second", "Tokens/s the cost policy predicted for the last round's "
                      "budget (0: not chosen by cost).", lambda: worker.stats().predicted_tokens_per_s)
    metrics.add_counters("rounds_by_tree_budget_total", "Decoding rounds by their tree budget (0: plain AR).", "budget",
                         lambda: {str(b): n for b, n in worker.stats().budget_rounds.items()})
    metrics.add_gauge("tokens_per_second", "Tokens committed per second, all requests, over the last 10 s.",
                      worker.tokens_per_second)
    metrics.add_counter("prefix_cache_lookups_total", "Admitted requests that looked for a cached prefix.",
                        lambda: worker.stats().prefix_lookups)
    metrics.add_counter("prefix_cache_hits_total", "Admitted requests that reused a cached prefix.",
                        lambda: worker.stats().prefix_hits)
    metrics.add_counter("prefix_cache_tokens_saved_total", "Prompt tokens reused from cached prefixes, not prefilled.",
                        lambda: worker.stats().prefix_tokens_saved)
    metrics.add_counter("prefix_cache_evictions_total", "Cached sequences dropped to free a row or KV pages.",
                        lambda: worker.stats().prefix_evictions)
    metrics.add_gauge("prefix_cache_sequences", "Finished requests' sequences held for prefix reuse.",
                      lambda: worker.stats().prefix_cached)
    metrics.add_gauge("kv_pages_total", "Pages of the engine's KV pool (kv_page_size tokens each).",
                      lambda: worker.stats().pages_total)
    metrics.add_gauge("kv_page_size", "Tokens a KV page holds.", lambda: 0 if worker.engine is None else worker.engine.info.limits.page_size)
    metrics.add_gauge("kv_pages_used", "KV pages held by running, prefilling and cached sequences.",
                      lambda: worker.stats().pages_used)
    metrics.add_gauge("kv_pages_free", "KV pages free now.",
                      lambda: worker.stats().pages_total - worker.stats().pages_used)
    metrics.add_gauge("kv_pages_shared", "KV pages held by more than one sequence (shared prompt prefixes).",
                      lambda: worker.stats().pages_shared)
    metrics.add_counter("preemptions_total", "Requests whose KV pages were taken back when the pool ran out "
                        "(recomputed later, the same output).", lambda: worker.stats().preemptions)
    metrics.add_counter("graph_captures_total", "CUDA graphs captured while serving: shapes the start-up warm-up "
                        "did not reach (each a pause of the engine's thread).",
                        lambda: worker.stats().graph_captures)
    metrics.add_gauge("requests_in_flight", "API requests being answered.", lambda: ctx.in_flight)
    metrics.add_gauge("engine_up", "1 when the engine is warmed up and its worker thread alive.",
                      lambda: 1 if worker.health()[0] == READY else 0)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        ctx.prep_pool.shutdown(wait=False, cancel_futures=True)
        worker.stop(timeout=5.0)

    # the schema, public (server/openapi.py says why); no docs pages: they would load scripts from a CDN
    app = FastAPI(title="ddtree-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=OPENAPI_PATH)
    app.openapi = lambda: openapi_document(app)
    app.state.ddtree = ctx
    app.include_router(router)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientDisconnect)
    async def _client_left_mid_upload(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; counted as 499, not logged as an error

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    app.add_middleware(_RequestMetrics, ctx=ctx)
    return app


class _RequestMetrics:
    """ASGI middleware: count requests by endpoint and status, time them to the last byte (streams
    included), and keep the in-flight count the drain waits on."""

    def __init__(self, app, ctx: ServerContext) -> None:
        self.app = app
        self._ctx = ctx

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        counted = path not in UNCOUNTED_IN_FLIGHT
        started = time.perf_counter()
        status = 500
        done = False
        client_gone = False

        async def receive_wrapper():
            nonlocal client_gone
            message = await receive()
            if message["type"] == "http.disconnect" and not done:
                client_gone = True
            return message

        async def send_wrapper(message) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True

        if counted:
            self._ctx.in_flight += 1
        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except Exception:
            status, done = 500, True  # the outer error middleware answers 500
            raise
        finally:
            if counted:
                self._ctx.in_flight -= 1
            # A client that left before the end of its response is counted as 499, as nginx does.
            status = 499 if client_gone or not done else status
            self._ctx.metrics.observe_request(endpoint, status, time.perf_counter() - started)
