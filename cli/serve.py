"""`bitnet serve`: an OpenAI-compatible HTTP server (serve/app.py) on uvicorn, over the batching
engine. Loopback by default; Ctrl-C / SIGTERM drain (stop admitting, cancel in-flight streams) and exit 0.
`--ray-replicas N` runs the same app as a Ray Serve deployment with N replicas (needs `pip install .[cluster]`)."""
import math

from ..engine.cpu import BATCH_TOKENS_DEFAULT, BATCH_TOKENS_MAX, BATCH_TOKENS_TILES
from ..serve.auth import is_loopback
from ..serve.limits import MiB, Limits
from .flags import add_engine_args, apply_chat_template, check_engine_args, given, sampling_params_from_args

# the router's flags: (flag, their defaults); given without --models-dir / --models-cache they are refused
ROUTER_FLAGS = {"--models-max": 3, "--models-keep-alive": "-1", "--models-load-timeout": 600.0}
# the defaults of the server's own connections, shutdown and log (under --ray-replicas too: its front,
# serve/ray_front.py, holds the connections there)
CONNECTION_DEFAULTS = {"--keep-alive-timeout": 5.0, "--drain-timeout": 5.0, "--log-level": "warning"}

HELP = "serve the model over HTTP: OpenAI's API (chat, completions, Responses), Anthropic's Messages, ollama's and llama-server's (and a chat page at /)"




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
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a free slot before answering 503 +"
                   " Retry-After (0: never wait)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health (several: KEY1,KEY2, as "
                        "llama-server)%(default).0s")
    p.add_argument("--api-key-file", default=None,
                   help="file of API keys, one per line (several users; # starts a comment, also after a key); "
                        "with or instead of --api-key%(default).0s")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--metrics", action="store_true",
                   help="accepted for llama-server's command lines: /metrics is always served (with the API key, "
                        "unless --metrics-public)")
    p.add_argument("-cb", "--cont-batching", dest="cont_batching", action="store_true",
                   help="accepted for llama-server's command lines: batching is always continuous here")
    p.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true",
                   help="accepted for llama-server's command lines: embeddings are always served (/v1/embeddings, "
                        "/embedding), next to chat")
    p.add_argument("--slots", dest="slots", action="store_true",
                   help="accepted for llama-server's command lines: /slots is always served (with the API key)")
    p.add_argument("--no-webui", dest="no_webui", action="store_true",
                   help="no chat page at / (llama-server's flag): GET / answers \"bitnet serve is running\" "
                        "(ollama's heartbeat still answered)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. https://app.example.com; null: sandboxed frames and "
                        "file:// pages; * = any) call the API from the "
                        "browser; pages of this machine (localhost, 127.0.0.1, app://, ...) always may, as with "
                        "ollama; repeatable%(default).0s")
    # what one client may cost (serve/limits.py; docs/serving-limits.md)
    d = Limits()
    p.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / MiB, help="largest request body (413 beyond)")
    p.add_argument("--max-header-kb", type=float, default=d.max_header_bytes / 1024, help="largest request line + headers (431 beyond)")
    p.add_argument("--max-headers", type=int, default=d.max_headers, help="most request headers (431 beyond)")
    p.add_argument("--max-connections", type=int, default=d.max_connections, help="open connections (503 + Retry-After beyond)")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout, help="seconds a request's headers may take to arrive (408)")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout, help="seconds a request's body may take to arrive (408)")
    p.add_argument("--send-timeout", type=float, default=d.send_timeout, help="seconds a client may leave what is sent to it unread before its connection is cut (nginx's send_timeout)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a request may run, 0 = no limit (504, or an error event mid-stream); with "
                        "--models-dir, from when its model has loaded")
    p.add_argument("--keep-alive-timeout", type=float, default=CONNECTION_DEFAULTS["--keep-alive-timeout"],
                   help="seconds an idle kept-alive connection stays open")
    p.add_argument("--alias", "-a", default=None, metavar="NAME",
                   help="the model id the server answers with (default: the model's name)%(default).0s")
    p.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to a request naming another model (default: any name gets this model, as llama-server)%(default).0s")
    p.add_argument("--ray-replicas", type=int, default=0,
                   help="run as a Ray Serve deployment with N replicas (0 = plain uvicorn); each replica runs -t "
                        "threads, 1 thread when -t is not given (not one per core); N x -t above the CPU cores is "
                        "capped, with a warning")
    g = p.add_argument_group("many models behind one port (ollama's way; llama-server's router mode)",
                             "a request's `model` picks the model; the first request naming one loads it "
                             "(docs/serving.md)")
    g.add_argument("--models-dir", action="append", default=None, metavar="DIR",
                   help="serve every model in DIR (*.bnstore, *.gguf, HF model directories), named by file; "
                        "repeatable%(default).0s")
    g.add_argument("--models-cache", action="store_true",
                   help="serve every converted model in the cache, named as `bitnet list` shows them")
    g.add_argument("--models-max", type=int, default=ROUTER_FLAGS["--models-max"], metavar="N",
                   help="models loaded at once; the least recently used idle one is unloaded for another")
    g.add_argument("--models-keep-alive", default=ROUTER_FLAGS["--models-keep-alive"], metavar="DURATION",
                   help="how long an idle model stays loaded (seconds or \"5m\"; -1 = until room is needed); a "
                        "request's keep_alive (ollama's field) sets its model's")
    g.add_argument("--models-load-timeout", type=float, default=ROUTER_FLAGS["--models-load-timeout"], metavar="S",
                   help="seconds a request waits for its model to load (a GGUF is converted on first use)")
    p.add_argument("--pooling", default="mean", metavar="{mean,last,none}",
                   help="the embedding of a text (llama-server's --pooling): the mean of its tokens' final states, "
                        "the last token's, or none: every token's (at /embedding only)")
    p.add_argument("--embd-normalize", dest="embd_normalize", type=int, default=2, metavar="N",
                   help="norm of pooled embeddings, as llama.cpp's: -1 none, 0 max-absolute int16, 1 taxicab, "
                        "2 Euclidean, >2 p-norm (a request's embd_normalize wins)")
    p.add_argument("--reasoning-format", dest="reasoning_format", default="auto",
                   choices=("auto", "deepseek", "deepseek-legacy", "none"),
                   help="a thinking model's <think> block in chat answers, when a request does not say (its "
                        "reasoning_format): auto / deepseek: message.reasoning_content, deepseek-legacy: streamed, left "
                        "in content with its tags (else as deepseek), none: left in content (llama-server's flag)")
    p.add_argument("--drain-timeout", type=float, default=CONNECTION_DEFAULTS["--drain-timeout"],
                   help="seconds in-flight requests get to finish on shutdown")
    p.add_argument("--log-level", default=CONNECTION_DEFAULTS["--log-level"],
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level")


def _check(args) -> list[str]:
    """BitNetError for a flag's bad value; else the warnings to print (one line each), for a value adjusted here."""
    from ..engine.errors import BitNetError
    warnings = []
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
    from ..engine.runtime.embed import check_normalize, check_pooling
    check_pooling(args.pooling, "--pooling")
    check_normalize(args.embd_normalize, "--embd-normalize")
    if args.ray_replicas < 0:
        raise BitNetError(f"--ray-replicas {args.ray_replicas}: must be >= 0")
    if args.ray_replicas:
        from ..engine.cpu import available_cores
        cores = available_cores()
        if args.ray_replicas > cores:   # each replica is an engine of its own: more only wait for the cores
            raise BitNetError(f"--ray-replicas {args.ray_replicas}: at most {cores} here (one engine per replica, "
                              "this machine's cores)")
        threads = args.threads or 1   # a replica's default (serve/ray_app.build): one thread, not one per core
        if args.ray_replicas * threads > cores:   # as plain serve's -t above the cores: capped, with a warning
            args.threads = cores // args.ray_replicas
            warnings.append(f"--ray-replicas {args.ray_replicas} x -t {threads} is {args.ray_replicas * threads} "
                            f"threads, more than the {cores} CPU cores available; using -t {args.threads} in "
                            "each replica")
    for flag in ("max_body_mb", "max_header_kb", "max_headers", "max_connections", "header_timeout", "body_timeout",
                 "send_timeout", "keep_alive_timeout"):
        if not 0 < getattr(args, flag) < math.inf:   # inf: an int of it failed later as an internal error
            unit = " of seconds" if flag.endswith("timeout") else ""   # "inf" is a number: say finite
            raise BitNetError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be a finite number{unit} > 0")
    if not 0 <= args.request_timeout < math.inf:
        raise BitNetError(f"--request-timeout {args.request_timeout}: must be a finite number of seconds >= 0 "
                          "(0 = no limit)")
    if not 0 <= args.drain_timeout < math.inf:   # nan / inf were taken, then broke the shutdown they time
        raise BitNetError(f"--drain-timeout {args.drain_timeout}: must be a number of seconds >= 0")
    from ..serve.auth import check_origin
    for origin in args.cors_origin or ():
        problem = check_origin(origin)
        if problem:
            raise BitNetError(f"--cors-origin {origin}: {problem}")
    if args.models_dir or args.models_cache:
        for flag, dest in (("-m", "model"), ("--alias", "alias"), ("--strict-model-name", "strict_model_name"),
                           ("--ray-replicas", "ray_replicas")):
            if getattr(args, dest):
                raise BitNetError(f"{flag} cannot be combined with --models-dir / --models-cache (they serve every "
                                  "model found there, each by its own name)")
        if args.models_max < 1:
            raise BitNetError(f"--models-max {args.models_max}: must be >= 1")
        if not 0 < args.models_load_timeout < math.inf:
            raise BitNetError(f"--models-load-timeout {args.models_load_timeout}: must be > 0")
        from ..serve.router import parse_keep_alive
        try:
            parse_keep_alive(args.models_keep_alive)
        except ValueError as e:
            raise BitNetError(f"--models-keep-alive {args.models_keep_alive}: not a duration",
                              hint="seconds, or a string such as 5m or 1h; -1 keeps models until room is needed"
                              ) from e
    else:   # the router's own flags, where there is no router: said, not ignored
        for flag, default in ROUTER_FLAGS.items():
            if given(args, flag, default):
                raise BitNetError(f"{flag} applies to --models-dir / --models-cache only (this server serves -m's "
                                  "one model)")
    return warnings


def bind_port(host: str, port: int):
    """The listening socket, bound here rather than by uvicorn (which logs '[Errno 98] ...' after we have said
    'listening' and exits 3) so that a port in use or an address this machine does not have is one line, exit 2.
    Bound as uvicorn binds (IPv6 when the host has a ':', else IPv4; SO_REUSEADDR to restart over TIME_WAIT), and
    listening at once (uvicorn's own backlog), so that a client that connects as soon as 'listening' is printed
    waits in the queue until the server accepts instead of being refused while uvicorn starts or the router
    scans its models (or Ray starts, under --ray-replicas)."""
    import errno
    import socket

    from ..engine.errors import BitNetError
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:   # socket.gaierror (a host name that does not resolve) included
        sock.close()
        hint = ("another process listens there (another bitnet serve?): stop it or choose another --port"
                if e.errno == errno.EADDRINUSE else "check --host (a name or address of this machine) and --port")
        raise BitNetError(f"cannot listen on {host}:{port}: {e.strerror or e}", hint=hint)
    return sock


def inherited_socket():
    """The listening socket a `bitnet serve --models-dir` router handed this model's process (BITNET_LISTEN_FD,
    serve/router.py), or None. The variable is taken out of the environment, so nothing this process starts
    inherits it."""
    import os
    import socket

    fd = os.environ.pop("BITNET_LISTEN_FD", None)
    if fd is None:
        return None
    try:
        return socket.socket(fileno=int(fd))
    except (ValueError, OSError) as e:
        from ..engine.errors import BitNetError
        raise BitNetError(f"BITNET_LISTEN_FD={fd}: not a socket this process holds ({e})") from None


def end_with_router():
    """A model's process under `bitnet serve --models-dir` (BITNET_ROUTER_PID set): SIGTERM (a drain) when the
    router dies, even by SIGKILL, so no model process outlives it holding its memory (Linux's PR_SET_PDEATHSIG;
    set here rather than between fork and exec, where the router's threads make Python code unsafe). A router
    already gone: exit at once."""
    import os
    import signal
    import sys

    pid = os.environ.pop("BITNET_ROUTER_PID", None)
    if pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != pid:
        raise SystemExit(1)


def _check_host(args) -> None:
    """--host as an address or a name only; llama-server's [::1] is taken as ::1 (brackets belong in URLs). An
    empty one (LLAMA_ARG_HOST=${HOST}, HOST unset) bound every interface, unguarded; a unix socket (llama-server
    listens on one when the host ends in .sock) or a URL were looked up as names, 5 s of DNS and then a
    misleading error."""
    from ..engine.errors import BitNetError
    if not args.host.strip():
        raise BitNetError(f"--host {args.host!r}: an empty address would listen on every network interface",
                          hint="leave --host out for this machine only (127.0.0.1), or give 0.0.0.0 for every one")
    if args.host.startswith("[") and args.host.endswith("]"):
        args.host = args.host[1:-1]
    if "://" in args.host and not args.host.startswith("unix://"):
        raise BitNetError(f"--host {args.host}: --host takes an address or name, not a URL (the port is --port)")
    if "/" in args.host or args.host.endswith(".sock"):
        raise BitNetError(f"--host {args.host}: unix sockets are not supported: --host takes an address or name")


def http_url(host: str, port: int) -> str:
    """The URL of host:port, an IPv6 address in brackets (http://[::1]:8080, as a browser or curl takes it)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


FILES_RESERVE = 32   # open files beside the connections: the model, logs, imports, the event loop's own
RAY_FILES_RESERVE = 256   # and under --ray-replicas, the Ray driver's (gRPC channels, core-worker pipes, plasma)


def fit_open_files(args, per_connection: int = 1, reserve: int = FILES_RESERVE) -> None:
    """Raise the open-files limit to its hard limit (as Go's runtime, hence ollama, does), and cap
    args.max_connections, with one warning naming both numbers, to what still fits: past the limit each new
    connection was reset silently and a request that needed a file (an import) failed, where the cap's 503 +
    Retry-After says what is wrong. per_connection: files one connection takes (the router's: its upstream too).
    A limit without room for the reserve and one connection is one line and exit 2: the server failed on its
    way up, on the first file an import opened, as "internal error ... a bug"."""
    import sys
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):   # not on this platform: nothing to fit to
        return
    want = args.max_connections * per_connection + reserve
    if soft != resource.RLIM_INFINITY and soft < want:
        for target in (hard, want):   # an unlimited hard limit may not be taken as such (Linux's nr_open)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
                break
            except (OSError, ValueError):
                continue
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    least = reserve + per_connection
    if soft < least:
        from ..engine.errors import BitNetError
        raise BitNetError(f"the open-files limit (ulimit -n) is {soft}, too low for bitnet serve: it needs at least "
                          f"{least} ({reserve} for the model, logs and imports, {per_connection} per connection)",
                          hint=f"raise it, e.g. `ulimit -n {want}` for --max-connections {args.max_connections}")
    fits = (soft - reserve) // per_connection
    print(f"bitnet serve: warning: --max-connections {args.max_connections} needs about {want} open files, more "
          f"than the limit of {soft} (ulimit -n): taking at most {fits} connection{'s' if fits != 1 else ''} (503 "
          f"beyond); raise ulimit -n to {want} for all of them", file=sys.stderr, flush=True)
    args.max_connections = fits


def server_class(limits):
    """uvicorn's Server as `bitnet serve` runs it, on asyncio's loop (not uvloop: out of descriptors, libuv resets
    every connection waiting without a word; asyncio says so to the loop's handler, where serve.limits'
    AcceptGuard answers them 503 out_of_resources and logs one line). Its signal handlers are ours: uvicorn
    re-raised the caught signal after shutdown (-> exit 130/143), where a drained server exits 0; ours are
    installed before asyncio.run, so its own SIGINT handler (task cancel) stays out (serve.limits.guarded_server,
    which Ray's front runs too)."""
    from ..serve.limits import guarded_server
    return guarded_server(limits)


def limits_from_args(args) -> Limits:
    return Limits(max_body_bytes=int(args.max_body_mb * MiB), max_header_bytes=int(args.max_header_kb * 1024),
                  max_headers=args.max_headers, max_connections=args.max_connections,
                  header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                  send_timeout=args.send_timeout, request_timeout=args.request_timeout)


def main(args) -> int:
    import signal
    import sys

    from ..engine import faults
    from ..engine.errors import BitNetError
    from .flags import from_variable

    faults.install("bitnet serve")   # a model file truncated while in use: its line starts as every server line

    end_with_router()
    try:
        _check_host(args)
        if not is_loopback(args.host) and not (args.api_key or args.api_key_file):
            print(f"bitnet serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
                  "port can use the model", file=sys.stderr, flush=True)
        for w in _check(args):
            print(f"bitnet serve: warning: {w}", file=sys.stderr, flush=True)
    except BitNetError as e:   # a value from LLAMA_ARG_PORT=... is said by the variable's name
        raise from_variable(e, getattr(args, "llama_env", None)) from None
    from ..serve.auth import read_key_file
    keys = tuple(read_key_file(args.api_key_file)) if args.api_key_file else ()
    if args.api_key is not None and not args.api_key.replace(",", "").strip():   # "", ",", "$A,$B" both unset
        from ..engine.errors import BitNetError
        raise BitNetError(f"--api-key {args.api_key!r}: no key in it (the server would answer anyone)",
                          hint="give a key, or leave --api-key out to serve without one")
    if args.api_key and "," in args.api_key:   # llama-server's --api-key K1,K2: several keys
        keys = tuple(k.strip() for k in args.api_key.split(",") if k.strip()) + keys
        args.api_key = None
    elif args.api_key:   # as a key file's lines and the headers sent: "K1, K2" or " K" is K2 / K, not " K2"
        args.api_key = args.api_key.strip()
    sampling = sampling_params_from_args(args)
    if args.models_dir or args.models_cache:
        return serve_models(args, keys)
    if args.ray_replicas:
        # each connection of the front holds one to Ray's proxy too, and this process is Ray's driver
        fit_open_files(args, per_connection=2, reserve=FILES_RESERVE + RAY_FILES_RESERVE)
        sock = bind_port(args.host, args.port)   # before Ray's minutes of start-up, not after; the front's
        from ..engine.errors import BitNetError
        try:
            from ..serve.ray_app import run_ray
        except ImportError as e:
            if (e.name or "").split(".")[0] != "ray":
                raise
            raise BitNetError(f"--ray-replicas needs Ray Serve, which is not installed here ({e})",
                              hint='pip install ".[cluster]", or serve without --ray-replicas') from None
        # the model resolved (a hub id converted once, here) and opened before Ray starts: a missing or unreadable
        # one is one line and exit 2, as the plain server says it, not replicas restarted for ever
        from ..engine.api import resolve_store
        try:
            args.model = resolve_store(args.model)
        except BaseException:
            sock.close()
            raise
        return run_ray(args, sampling, api_keys=keys, limits=limits_from_args(args), sock=sock)

    import uvicorn

    from ..engine.api import load_engine
    from ..engine.errors import EXIT_BAD_INPUT, EXIT_BUG, BitNetError
    from ..serve.app import create_app
    from ..serve.limits import guarded_protocol

    from ..engine.runtime.speculative import lookup_from_flags

    lookup = lookup_from_flags(args.draft_max, args.lookup_ngram_min)

    def load():
        eng = load_engine(args.model, ctx=args.ctx, threads=args.threads, parallel=args.parallel,
                          max_batch_tokens=args.batch_size, max_queue=args.max_queue, kv_dtype=args.kv, progress=True,
                          lookup=lookup, mmap=args.mmap, pooling=args.pooling, embd_normalize=args.embd_normalize)
        apply_chat_template(eng, args)
        for w in eng.warnings:   # a default context past the trained one, -t above the cores
            print(f"bitnet serve: warning: {w}", file=sys.stderr, flush=True)
        return eng

    fit_open_files(args)
    limits = limits_from_args(args)
    failed: list = []

    def load_failed(e: BaseException):
        """A model that does not load (a typo in -m, a corrupt file): one line and a non-zero exit, as `bitnet run`,
        never a server answering 503 for ever."""
        failed.append(e)
        server.should_exit = True
    app = create_app(load, api_key=args.api_key, api_keys=keys, sampling=sampling, limits=limits,
                     metrics_public=args.metrics_public, model_id=args.alias, strict_model=args.strict_model_name,
                     cors_origins=tuple(args.cors_origin or ()), on_load_error=load_failed,
                     reasoning_format=args.reasoning_format, local_only=is_loopback(args.host),
                     webui=not args.no_webui, model_format=given_format(args.model))

    Server = server_class(limits)

    signals = []

    def handler(sig, frame):
        import threading
        signals.append(sig)
        server.should_exit = True
        # what is still running at the drain's deadline is cancelled in the engine, so every handler ends its
        # answer itself (a stream's last event, a partial answer) before uvicorn would cancel it (a 500, a
        # traceback). A second signal brings the deadline to now; only a third stops at once, as uvicorn does.
        if len(signals) >= 3:
            server.force_exit = True
            return
        app.state.bitnet.draining = True  # stop admitting; /health says 503 to load balancers
        t = threading.Timer(args.drain_timeout if len(signals) == 1 else 0.0, deadline)
        t.daemon = True
        t.start()

    def deadline():
        app.state.bitnet.drain()
        protocol.stopping()   # a client that reads nothing would hold its handler's last send past uvicorn's timeout

    protocol = guarded_protocol(limits)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout + 2, lifespan="on",
                            http=protocol, timeout_keep_alive=args.keep_alive_timeout, loop="asyncio",
                            h11_max_incomplete_event_size=limits.max_header_bytes)
    server = Server(config)
    sock = inherited_socket() or bind_port(args.host, args.port)   # a port in use: one line before the load
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):   # SIGHUP: its terminal closed
        if sig is not None:
            signal.signal(sig, handler)
    print(f"bitnet serve: listening on {http_url(args.host, args.port)} (loading the model...)", file=sys.stderr,
          flush=True)
    server.run(sockets=[sock])
    if failed:
        e = failed[0]
        if isinstance(e, KeyboardInterrupt):
            return 130
        if isinstance(e, BitNetError) and e.exit_code != EXIT_BUG:
            print(f"bitnet serve: error: {e}", file=sys.stderr)
            return e.exit_code
        from . import out_of_memory
        if out_of_memory(e):   # MemoryError, a library that could not be mapped (ulimit -v)
            print("bitnet serve: error: out of memory loading the model (hint: a smaller -c/--ctx or --parallel)",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        import errno
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):   # an import, a file of the model
            from ..serve.limits import nofile
            print(f"bitnet serve: error: out of open files loading the model ({e.strerror}; {nofile()}) (hint: "
                  "raise ulimit -n)", file=sys.stderr)
            return EXIT_BAD_INPUT
        from . import report_bug
        return report_bug("bitnet serve", e)
    print("bitnet serve: stopped", file=sys.stderr)
    from . import stopped_with
    return stopped_with(0)   # a second signal while the process ends: exit 0 still


# flags of the router alone: everything else is passed on to each model's process
ROUTER_ONLY = {"help", "model", "host", "port", "api_key", "api_key_file", "metrics_public", "cors_origin", "alias",
               "strict_model_name", "ray_replicas", "models_dir", "models_cache", "models_max", "models_keep_alive",
               "models_load_timeout", "no_jinja"}   # no_jinja: warned of once, by the router
MODEL_SUFFIXES = {".bnstore": "bnstore", ".gguf": "gguf"}


def given_format(model: str | None) -> str:
    """ollama's details.format of the model a server was started with (-m): of what the user gave, as a router
    lists that file: "gguf" for a GGUF file (served from its conversion in the cache), "safetensors" for a Hugging
    Face model directory, "bnstore" for a store, a hub id (its conversion in the cache, which a router lists as a
    store) or None (the bundled model)."""
    import os

    from ..engine.formats.gguf import is_gguf
    if model is None or not os.path.exists(model):
        return "bnstore"
    if os.path.isdir(model):
        return "safetensors"
    return "gguf" if is_gguf(model) else "bnstore"


def _spec(name: str, path: str, files: list, fmt: str):
    """The ModelSpec of a model made of `files` (a GGUF file, every part of a split one, an HF folder's files):
    its size is theirs together, and its stamp holds each one's size and mtime, so replacing any of them (part 2
    of a split, one shard) is a new model to the router, which loads it anew, as it does for a single file."""
    import os

    from ..serve.router import ModelSpec
    size, modified, stamp = 0, 0.0, []
    for x in files:
        try:
            st = os.stat(x)
        except OSError:
            stamp.append((os.path.basename(x), None))   # a part not there yet: its coming is a change too
            continue
        if os.path.isfile(x):
            size, modified = size + st.st_size, max(modified, st.st_mtime)
            stamp.append((os.path.basename(x), st.st_size, st.st_mtime_ns))
    return ModelSpec(name, path, size, modified, fmt, stamp=tuple(stamp))


_NOT_UTF8_SAID: set = set()


def _utf8_name(path: str) -> bool:
    """Whether a file of a --models-dir has a UTF-8 name: a model's name is its file name, and one that is not
    UTF-8 cannot be sent in JSON nor named by a client. Said once (a line on stderr, the bytes escaped), not at
    every scan of the router."""
    import os
    import sys

    try:
        os.path.basename(path).encode("utf-8")
        return True
    except UnicodeEncodeError:
        if path not in _NOT_UTF8_SAID:
            _NOT_UTF8_SAID.add(path)
            shown = os.fsencode(path).decode("utf-8", "backslashreplace")
            print(f"bitnet serve: skipping {shown}: its name is not UTF-8 (rename the file to serve it)",
                  file=sys.stderr, flush=True)
        return False


def model_catalog(args, clash=None) -> dict:
    """name -> serve.router.ModelSpec: the cache's converted models (--models-cache), then each --models-dir's
    stores, GGUF files and HF model directories (a directory with a config.json). Two models of one name: one
    line, exit 2 (at start); with `clash` (the router's later scans) clash(message) and the first one is kept,
    so one file added under a taken name does not stop every other change from being seen."""
    import os

    from ..engine.errors import BitNetError
    from ..engine.formats.gguf import SPLIT_NAME, split_part
    from ..serve.router import ModelSpec
    found: list = []
    if args.models_cache:
        from .list import cached_stores
        from ..engine.formats.hub import hub_names
        for row in cached_stores():
            source = row["source"] if row["source"] != "?" else ""
            found.append(ModelSpec(row["name"], row["path"], row["size"], row["last_used"], "bnstore",
                                   source=source, cached=True, names=tuple(hub_names(source))))
    seen: set = set()
    for d in args.models_dir or ():
        if not os.path.isdir(d):
            raise BitNetError(f"--models-dir {d}: not a directory")
        if os.path.realpath(d) in seen:   # one directory given twice (d and d/, a link to it): its files once
            continue
        seen.add(os.path.realpath(d))
        for f in sorted(os.listdir(d)):
            path = os.path.join(d, f)
            if not _utf8_name(path):
                continue
            suffix = os.path.splitext(f)[1]
            if suffix in MODEL_SUFFIXES and os.path.isfile(path):
                name, files = f[: -len(suffix)], [path]
                part = SPLIT_NAME.match(f)   # a split GGUF is one model, named by its prefix, loaded from part 1
                if part is not None:
                    if part.group(2) != "00001":
                        continue
                    name = os.path.basename(part.group(1)) or name   # "-00001-of-00002.gguf": no prefix to name it
                    files = [split_part(path, i) for i in range(1, int(part.group(3)) + 1)]
                found.append(_spec(name, path, files, MODEL_SUFFIXES[suffix]))
            elif os.path.isfile(os.path.join(path, "config.json")):
                found.append(_spec(f, path, [os.path.join(path, x) for x in sorted(os.listdir(path))], "safetensors"))
    models: dict = {}
    for spec in found:
        if spec.name in models:
            why = f"two models named '{spec.name}': {models[spec.name].path} and {spec.path}"
            if clash is None:
                raise BitNetError(why, hint="rename one of the files (a model's name is its file name)")
            clash(why)
            continue
        models[spec.name] = spec
    return models


def passthrough_argv(args) -> list:
    """The flags this `bitnet serve` was given that each model's process takes as they are (threads, context,
    KV, sampling defaults, limits, ...): every option of the serve parser off its default, but the router's own."""
    import argparse

    from . import build_parser
    subparsers: dict = {}
    build_parser(subparsers)
    out: list = []
    for a in subparsers["serve"]._actions:
        if not a.option_strings or a.dest in ROUTER_ONLY:
            continue
        v = getattr(args, a.dest, None)
        if v is None or v == a.default:
            continue
        flag = a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]
        if isinstance(a, (argparse._StoreConstAction, argparse._StoreTrueAction)):
            if v == a.const:
                out.append(flag)
        elif isinstance(a, argparse._AppendAction):   # FLAG=VALUE: a value may start with '-'
            for x in v:
                out.append(_as_argv(f"{flag}={x}"))
        else:
            out.append(_as_argv(f"{flag}={v}"))
    return out


def _as_argv(arg: str) -> str:
    """arg as a process's argument: the parser made typed UTF-8 text (Parser.parse_known_args), which a locale that
    is not UTF-8 (LANG=C, PYTHONUTF8=0) cannot encode for exec; its UTF-8 bytes then, in the form the OS's
    encoding hands them on (surrogateescape), which the model's process reads back as this text."""
    import os
    try:
        os.fsencode(arg)
        return arg
    except UnicodeEncodeError:
        return os.fsdecode(arg.encode("utf-8"))


def serve_models(args, keys: tuple) -> int:
    """`bitnet serve --models-dir DIR / --models-cache`: serve.router on uvicorn; each model in its own
    `bitnet serve` process, started on first use."""
    import shutil
    import signal
    import sys

    import uvicorn

    from ..serve.limits import guarded_protocol
    from ..serve.router import Router, create_router_app, parse_keep_alive

    from ..engine.errors import BitNetError
    models = model_catalog(args)
    if not models and not args.models_cache:
        raise BitNetError(f"no models in {', '.join(args.models_dir)}", hint="*.bnstore, *.gguf or HF model "
                          "directories; or serve the cache with --models-cache (`bitnet pull` adds to it)")
    if not models:   # as ollama starts with none: a client pulls one (ollama's /api/pull) or `bitnet pull` adds it
        print("bitnet serve: no models in the cache yet: `bitnet pull REPO` or ollama's /api/pull (hf.co/OWNER/REPO) "
              "adds one, served at once", file=sys.stderr, flush=True)
    passthrough = passthrough_argv(args)

    def command(spec, port: int, key_file: str) -> list:
        # NAME=value forms: a model named "-dash" (its file -dash.bnstore) is a value, not an option
        return [sys.executable, "-m", "bitnet_cpu", "serve", f"--model={spec.path}", "--host", "127.0.0.1",
                "--port", str(port), f"--alias={spec.name}", f"--api-key-file={key_file}", *passthrough]

    def pull(ref: str) -> list:   # ollama's /api/pull on a --models-cache server: into the cache it serves
        return [sys.executable, "-m", "bitnet_cpu", "pull", "--json-progress", "--", ref]   # never an option

    fit_open_files(args, per_connection=2)   # each proxied connection holds one to the model's process too
    limits = limits_from_args(args)
    sock = bind_port(args.host, args.port)   # first: a port in use leaves nothing behind (the router's key file)
    said: set = set()

    def clash(why: str):   # said once per pair, not at every scan
        if why not in said:
            said.add(why)
            print(f"bitnet serve: {why}: serving the first (rename one of the files)", file=sys.stderr, flush=True)
    def source_of(ref: str) -> str | None:   # what REPO@REV names in the download cache (never the network)
        from ..engine.formats.hub import resolve_hub_ref
        try:
            return resolve_hub_ref(ref)[1]
        except BitNetError:
            return None

    sampling = sampling_params_from_args(args)

    def describe(spec) -> dict:
        """ollama's /api/show answer of a model from its file, its weights unread (as its process would give it
        once loaded, with this command line's context, sampling defaults and chat template): never a load."""
        from ..engine.api import engine_ctx, model_card
        from ..serve.ollama import model_details, show_answer
        from ..serve.schemas import utc_iso
        card = model_card(spec.path, chat_template=getattr(args, "chat_template_text", None))
        return show_answer(cfg=card.config, name=card.name, template=card.chat_template, thinks=card.thinks,
                           path=spec.path, n_ctx=engine_ctx(card.config, args.ctx), sampling=sampling,
                           details=model_details(card.config, spec.format), modified_at=utc_iso(spec.modified or 0))

    router = Router(lambda: model_catalog(args, clash), command, pull=pull if args.models_cache else None,
                    describe=describe,
                    source_of=source_of if args.models_cache else None,
                    models_max=args.models_max, keep_alive=parse_keep_alive(args.models_keep_alive),
                    load_timeout=args.models_load_timeout, stop_timeout=args.drain_timeout + 5)
    app = create_router_app(router, api_keys=(([args.api_key] if args.api_key else []) + list(keys)),
                            limits=limits, metrics_public=args.metrics_public, cors_origins=tuple(args.cors_origin or ()),
                            local_only=is_loopback(args.host), webui=not args.no_webui)

    Server = server_class(limits)   # as in main(): ours, so that a drained router exits 0

    router_signals = []

    def handler(sig, frame):
        # as main(): a second signal passes on to the models' processes (theirs ends their drain at once), and only
        # a third stops at once (forced on the second, uvicorn skipped the shutdown and logged a traceback)
        router_signals.append(sig)
        if len(router_signals) >= 3:
            server.force_exit = True
        server.should_exit = True
        router.begin_drain()   # each model's process finishes its streams (within --drain-timeout) and exits
        import threading
        t = threading.Timer(args.drain_timeout if len(router_signals) == 1 else 0.0, protocol.stopping)
        t.daemon = True   # then clients that read nothing are cut, as in main()
        t.start()

    protocol = guarded_protocol(limits)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout + 2, lifespan="on",
                            http=protocol, timeout_keep_alive=args.keep_alive_timeout, loop="asyncio",
                            h11_max_incomplete_event_size=limits.max_header_bytes)
    server = Server(config)
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):   # SIGHUP: its terminal closed
        if sig is not None:
            signal.signal(sig, handler)
    names = ", ".join(sorted(models))
    count = f"{len(models)} model{'s' if len(models) != 1 else ''}"
    print(f"bitnet serve: listening on {http_url(args.host, args.port)} ({count}, each loaded on first use, at most "
          f"{args.models_max} at once{': ' + names if names else ''})", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:   # the key file and the models' logs, whatever ended the server (its shutdown removes them too)
        shutil.rmtree(router.logdir, ignore_errors=True)
    print("bitnet serve: stopped", file=sys.stderr)
    from . import stopped_with
    return stopped_with(0)   # a second signal while the process ends: exit 0 still
