"""Start the HTTP server at once and load the model in the background.

/health answers 503 while the model loads and 200 once the engine is ready. If loading fails the process
exits with status 1: a server that cannot serve must not stay up looking healthy-but-loading forever.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

import uvicorn

from tierlm.runtime.errors import StartupError
from tierlm.runtime.server_args import BUILTIN_MODEL_NAME, ServerArgs

if TYPE_CHECKING:  # run_server imports the engine, so `tierlm --help` and friends stay quick
    from tierlm.runtime.engine import Engine

logger = logging.getLogger("tierlm.launch")
FORCE_EXIT_AFTER_S = 10.0  # if uvicorn does not stop by itself after a failed load, exit anyway


def http_implementation() -> tuple[str, str]:
    """uvicorn's (loop, http): uvloop and httptools (C) where installed, else asyncio and h11 (pure Python), logged.
    The event loop shares the GIL with the scheduler thread, and every streamed token costs it a wake-up, an SSE
    event and a socket write: with asyncio + h11 ~0.3 ms of Python a token at one stream, all of it time the
    scheduler may wait for the GIL."""
    loop = "uvloop" if _imports("uvloop") else "asyncio"
    http = "httptools" if _imports("httptools") else "h11"
    if (loop, http) != ("uvloop", "httptools"):
        logger.info("HTTP: %s event loop, %s parser (pip install uvloop httptools for the faster C ones)", loop, http)
    else:
        logger.info("HTTP: uvloop event loop, httptools parser")
    return loop, http


def _imports(module: str) -> bool:
    """Whether ``module`` imports (installed is not enough: a wheel built for another Python fails here, not later)."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any failure means: use the pure-Python one
        return False
    return True


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", force=True)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails in a second instead of after a long load."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --port or stop the "
                           "process using it") from None
    sock.set_inheritable(True)
    return sock


def _display_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def ready_message(args: ServerArgs, seconds: float) -> str:
    url = _display_url(args.host, args.port)
    auth = " -H 'Authorization: Bearer <api-key>'" if args.api_key else ""
    return (
        f"tierlm ready in {seconds:.1f} s: serving '{args.model_name}' at {url} (OpenAI base URL {url}/v1)\n"
        f"  open {url}/ in a browser: a chat, and where each prompt's KV came from across the cache tiers\n"
        f"  try: curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{{\"model\": \"{args.model_name}\", \"prompt\": \"Once upon a time\", \"max_tokens\": 32}}'"
    )


class ModelLoader:
    """Runs engine.start() in a thread; on failure asks the HTTP server to stop and marks the exit status 1."""

    def __init__(self, engine: Engine, server: uvicorn.Server, args: ServerArgs) -> None:
        self.engine = engine
        self.server = server
        self.args = args
        self.failed = False
        self.thread = threading.Thread(target=self._run, name="tierlm-model-loader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        logger.info("loading model %s in the background; /health answers 503 until it is ready",
                    self.args.model_path or f"{BUILTIN_MODEL_NAME} (built-in)")
        try:
            self.engine.start()
        except StartupError as e:
            logger.error("startup failed: %s", e)
            self._fail()
            return
        except BaseException:  # noqa: BLE001 - any failure to load means the server cannot serve
            logger.exception("startup failed: unexpected error while loading the model")
            self._fail()
            return
        logger.info(ready_message(self.args, time.monotonic() - t0))

    def _fail(self) -> None:
        self.failed = True
        logger.error("shutting down: the server cannot serve without a loaded model (exit status 1)")
        self.server.should_exit = True
        timer = threading.Timer(FORCE_EXIT_AFTER_S, lambda: os._exit(1))
        timer.daemon = True
        timer.start()


def run_server(args: ServerArgs) -> None:
    """Serve until interrupted. Exits the process with status 1 if the port is busy or the model fails to load."""
    from tierlm.runtime.engine import Engine
    from tierlm.server.app import create_app

    configure_logging(args.log_level)
    logger.info("settings: %s", args.to_dict())
    try:
        sock = bind_socket(args.host, args.port)
    except StartupError as e:
        logger.error("startup failed: %s", e)
        raise SystemExit(1) from None
    engine = Engine(args)
    app = create_app(engine, shutdown_engine_on_exit=True)
    # access_log off: server/http/request_log.py writes one richer line per request
    loop, http = http_implementation()
    config = uvicorn.Config(app, log_config=None, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=30, loop=loop, http=http)
    server = uvicorn.Server(config)
    loader = ModelLoader(engine, server, args)
    loader.start()
    try:
        server.run(sockets=[sock])  # re-raises SIGINT/SIGTERM once it has shut down (engine stopped in lifespan)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    if loader.failed:
        logging.shutdown()
        os._exit(1)  # threads the failed load left behind must not keep the process alive
    if not engine.ready:
        logger.info("stopped while the model was still loading")
        logging.shutdown()
        os._exit(0)
    logger.info("server stopped")
