"""`bitnet serve`: an OpenAI-compatible HTTP server (serve/app.py) on uvicorn, over the batching
engine. Loopback by default; Ctrl-C / SIGTERM drain (stop admitting, cancel in-flight streams) and exit 0.
`--ray-replicas N` runs the same app as a Ray Serve deployment with N replicas (needs `pip install .[cluster]`)."""
from ..engine.cpu import BATCH_TOKENS_DEFAULT, BATCH_TOKENS_MAX, BATCH_TOKENS_TILES
from ..serve.limits import MiB, Limits
from .flags import add_engine_args, check_engine_args, sampling_params_from_args

HELP = "serve the model over HTTP: OpenAI's API (chat, completions, Responses), Anthropic's Messages, ollama's and llama-server's (and a chat page at /)"


def is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_arguments(p):
    # sampling flags: the defaults of every request that leaves a field out (a request's own values win);
    # --draft-max / --lookup-ngram-min: every sequence of the batching engine
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--parallel", "-np", type=int, default=16, help="sequences generated at once")
    p.add_argument("--batch-size", "-b", type=int, default=None, metavar="N",
                   help="tokens one step computes at most: a token of every decoding sequence, then prompt tokens "
                        f"(default {BATCH_TOKENS_DEFAULT}, {BATCH_TOKENS_TILES} where the AMX tiles run; smaller keeps "
                        "the other streams moving while a long prompt is read, larger gives a prompt's matrix "
                        f"products more rows; 1..{BATCH_TOKENS_MAX})%(default).0s")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 503 + Retry-After")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health%(default).0s")
    p.add_argument("--api-key-file", default=None, help="file of API keys, one per line (several users); with or instead of --api-key%(default).0s")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    # what one client may cost (serve/limits.py; docs/serving-limits.md)
    d = Limits()
    p.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / MiB, help="largest request body (413 beyond)")
    p.add_argument("--max-header-kb", type=float, default=d.max_header_bytes / 1024, help="largest request line + headers (431 beyond)")
    p.add_argument("--max-headers", type=int, default=d.max_headers, help="most request headers (431 beyond)")
    p.add_argument("--max-connections", type=int, default=d.max_connections, help="open connections (503 + Retry-After beyond)")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout, help="seconds a request's headers may take to arrive (408)")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout, help="seconds a request's body may take to arrive (408)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, help="seconds a request may run, 0 = no limit (504, or an error event mid-stream)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, help="seconds an idle kept-alive connection stays open")
    p.add_argument("--alias", default=None, metavar="NAME",
                   help="the model id the server answers with (default: the model's name)")
    p.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to a request naming another model (default: any name gets this model, as llama-server)")
    p.add_argument("--ray-replicas", type=int, default=0, help="run as a Ray Serve deployment with N replicas (0 = plain uvicorn)")
    p.add_argument("--drain-timeout", type=float, default=5.0, help="seconds in-flight requests get to finish on shutdown")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level")


def _check(args):
    from ..engine.errors import BitNetError
    problem = check_engine_args(args)
    if problem:
        raise BitNetError(problem)
    if not (0 < args.port < 65536):
        raise BitNetError(f"--port {args.port}: must be in 1..65535")
    if args.parallel < 1:
        raise BitNetError(f"--parallel {args.parallel}: must be >= 1")
    if args.batch_size is not None and not 1 <= args.batch_size <= BATCH_TOKENS_MAX:
        raise BitNetError(f"--batch-size {args.batch_size}: must be in 1..{BATCH_TOKENS_MAX}")
    if args.max_queue < 0:
        raise BitNetError(f"--max-queue {args.max_queue}: must be >= 0")
    if args.alias is not None and not args.alias.strip():
        raise BitNetError("--alias: must not be empty")
    if args.ray_replicas < 0:
        raise BitNetError(f"--ray-replicas {args.ray_replicas}: must be >= 0")
    for flag in ("max_body_mb", "max_header_kb", "max_headers", "max_connections", "header_timeout", "body_timeout",
                 "keep_alive_timeout"):
        if not getattr(args, flag) > 0:
            raise BitNetError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be > 0")
    if not args.request_timeout >= 0:
        raise BitNetError(f"--request-timeout {args.request_timeout}: must be >= 0 (0 = no limit)")


def bind_port(host: str, port: int, keep: bool = True):
    """The listening socket, bound here rather than by uvicorn (which logs '[Errno 98] ...' after we have said
    'listening' and exits 3) so that a port in use or an address this machine does not have is one line, exit 2.
    Bound as uvicorn binds (IPv6 when the host has a ':', else IPv4; SO_REUSEADDR to restart over TIME_WAIT).
    keep=False only checks (Ray Serve's proxy binds the port itself) and closes it again."""
    import errno
    import socket

    from ..engine.errors import BitNetError
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:   # socket.gaierror (a host name that does not resolve) included
        sock.close()
        hint = ("another process listens there (another bitnet serve?): stop it or choose another --port"
                if e.errno == errno.EADDRINUSE else "check --host (a name or address of this machine) and --port")
        raise BitNetError(f"cannot listen on {host}:{port}: {e.strerror or e}", hint=hint)
    if not keep:
        sock.close()
        return None
    return sock


def limits_from_args(args) -> Limits:
    return Limits(max_body_bytes=int(args.max_body_mb * MiB), max_header_bytes=int(args.max_header_kb * 1024),
                  max_headers=args.max_headers, max_connections=args.max_connections,
                  header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                  request_timeout=args.request_timeout)


def main(args) -> int:
    import contextlib
    import signal
    import sys

    if not is_loopback(args.host) and not (args.api_key or args.api_key_file):
        print(f"bitnet serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
              "port can use the model", file=sys.stderr, flush=True)
    _check(args)
    from ..serve.auth import read_key_file
    keys = tuple(read_key_file(args.api_key_file)) if args.api_key_file else ()
    sampling = sampling_params_from_args(args)
    if args.ray_replicas:
        bind_port(args.host, args.port, keep=False)   # before Ray's minutes of start-up, not after
        from ..serve.ray_app import run_ray
        return run_ray(args, sampling, api_keys=keys, limits=limits_from_args(args))

    import uvicorn

    from ..engine.api import load_engine
    from ..serve.app import create_app
    from ..serve.limits import guarded_protocol

    from ..engine.runtime.speculative import lookup_from_flags

    lookup = lookup_from_flags(args.draft_max, args.lookup_ngram_min)

    def load():
        eng = load_engine(args.model, ctx=args.ctx, threads=args.threads, parallel=args.parallel,
                          max_batch_tokens=args.batch_size, max_queue=args.max_queue, kv_dtype=args.kv, progress=True,
                          lookup=lookup, mmap=args.mmap)
        for w in eng.warnings:   # a default context past the trained one, -t above the cores
            print(f"bitnet serve: warning: {w}", file=sys.stderr, flush=True)
        return eng

    limits = limits_from_args(args)
    app = create_app(load, api_key=args.api_key, api_keys=keys, sampling=sampling, limits=limits,
                     metrics_public=args.metrics_public, model_id=args.alias, strict_model=args.strict_model_name)

    class Server(uvicorn.Server):
        """uvicorn re-raises the caught signal after shutdown (-> exit 130/143); a drained server exits 0.
        Our handlers are installed before asyncio.run, so its own SIGINT handler (task cancel) stays out."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    def handler(sig, frame):
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True
        if not app.state.bitnet.draining:
            app.state.bitnet.draining = True  # stop admitting; /health says 503 to load balancers
            # what is still running at the deadline is cancelled in the engine, so every handler ends its answer
            # itself (a stream's last event, a partial answer) before uvicorn would cancel it (a 500, a traceback)
            import threading
            t = threading.Timer(args.drain_timeout, app.state.bitnet.drain)
            t.daemon = True
            t.start()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout + 2, lifespan="on",
                            http=guarded_protocol(limits), timeout_keep_alive=args.keep_alive_timeout,
                            h11_max_incomplete_event_size=limits.max_header_bytes)
    server = Server(config)
    sock = bind_port(args.host, args.port)   # a port in use is one line before anything is loaded
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    print(f"bitnet serve: listening on http://{args.host}:{args.port} (loading the model...)", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    print("bitnet serve: stopped", file=sys.stderr)
    return 0
