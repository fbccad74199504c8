"""Scale-out on Ray Serve: the same ASGI app (app.py) as a Ray Serve deployment, one engine per replica.

    serve run bitnet_cpu.serve.ray_app:app          # settings from BITNET_MODEL, BITNET_THREADS, BITNET_PARALLEL,
                                                # BITNET_CTX, BITNET_MAX_QUEUE, BITNET_API_KEY, BITNET_REPLICAS
    bitnet serve --ray-replicas N [...]         # starts a local Ray, runs N replicas, stops on Ctrl-C

Ray Serve's proxy spreads requests over the replicas and its controller replaces a replica that dies. Each
replica loads its engine in its constructor, so Ray sends it requests only once the model is loaded, and a
model that does not load fails the deployment (serve.run raises) instead of replicas restarted for ever.
Needs `pip install .[cluster]`. The BITNET_* variables are read when `app` is first looked up (`serve run`),
never on import: `bitnet serve` builds its own application from its flags.
"""
from __future__ import annotations

import contextlib
import os

from ray import serve

from ..engine.errors import BitNetError
from .app import create_app


def build(model: str | None = None, *, threads: int | None = 1, parallel: int = 16, ctx: int | None = None,
          max_queue: int = 64, api_key: str | None = None, replicas: int = 1, kv: str = "f16", lookup=None,
          sampling=None, mmap: bool | None = None, alias: str | None = None, strict_model: bool = False,
          api_keys: tuple = (), limits=None, metrics_public: bool = False, batch_size: int | None = None,
          cors_origins: tuple = (), chat_template: str | None = None, chat_template_source: str | None = None,
          template_kwargs: dict | None = None, reasoning_format: str = "auto", pooling: str = "mean",
          embd_normalize: int = 2, local_only: bool = False, webui: bool = True):
    """A bound Ray Serve application with `replicas` replicas of the server (lookup: engine LookupParams;
    sampling: the SamplingParams a request's omitted sampling fields take; mmap: load_engine's — each replica
    otherwise reads its own copy of the weights into memory, while memory lasts; batch_size: load_engine's
    max_batch_tokens, None its default)."""

    def load():
        from ..engine.api import load_engine
        eng = load_engine(model, ctx=ctx, threads=threads, parallel=parallel, max_queue=max_queue, kv_dtype=kv,
                          progress=False, lookup=lookup, mmap=mmap, max_batch_tokens=batch_size, pooling=pooling,
                          embd_normalize=embd_normalize)
        if chat_template is not None:   # --chat-template(-file), checked by the CLI
            eng.set_chat_template(chat_template, source=chat_template_source)
        if template_kwargs:   # --chat-template-kwargs / -rea / --reasoning-effort
            eng.set_template_kwargs(template_kwargs)
        return eng

    # limits: body, headers, request time (serve/limits.py's middleware); connections and slow clients are
    # bounded by `bitnet serve --ray-replicas`' front (serve/ray_front.py), not under `serve run`
    fastapi_app = create_app(_preloaded_or(load), api_key=api_key, sampling=sampling, model_id=alias,
                             strict_model=strict_model,
                             api_keys=api_keys, limits=limits, metrics_public=metrics_public, cors_origins=cors_origins,
                             reasoning_format=reasoning_format, local_only=local_only,
                             wait_load=True, webui=webui)

    # num_cpus=0: the engine's own threads do the work; Ray must not refuse replicas on a small machine
    @serve.deployment(name="bitnet", num_replicas=replicas, ray_actor_options={"num_cpus": 0},
                      health_check_period_s=2, health_check_timeout_s=30, max_ongoing_requests=max(64, parallel + max_queue))
    @serve.ingress(fastapi_app)
    class BitNetServer:
        def __init__(self):
            # loaded here, not in the app's loading thread: a replica whose constructor has not returned gets no
            # requests (they were answered 503 "model is loading" and 500 while a replacement loaded), and one
            # that raises counts towards failing the deployment (it was restarted every few seconds, for ever)
            eng = _preload(load)
            import logging
            for w in getattr(eng, "warnings", ()):   # in the replica's log, which `serve run` shows
                logging.getLogger("ray.serve").warning("bitnet: warning: %s", w)

        def warnings(self) -> list:
            """The engine's load warnings (a context past the trained one, ...), for the driver to print."""
            eng = self._asgi_app.state.bitnet.engine
            return list(getattr(eng, "warnings", ())) if eng is not None else []

        def check_health(self):
            st = self._asgi_app.state.bitnet  # this replica's own copy of the app
            if st.load_error:
                raise RuntimeError(f"model failed to load: {st.load_error}")

    return BitNetServer.bind()


# the replica's engine, loaded by its constructor and taken by its app's first load() (one replica per process);
# module functions, so the constructor and the app (pickled apart) reach this module's one slot in the replica
_PRELOADED: list = []
LOAD_FAILED = "bitnet: the model failed to load on a replica: "   # run_ray finds the reason after it


def _preload(load):
    """The engine load() made, kept for the app's first load() (which may take it at once, in its own thread)."""
    try:
        eng = load()
        _PRELOADED[:] = [eng]
        return eng
    except Exception as e:   # one line the driver can find in Ray's report of the failed deployment
        raise RuntimeError(LOAD_FAILED + (str(e).strip().splitlines() or [type(e).__name__])[0]) from e


def _preloaded_or(load):
    def take():
        return _PRELOADED.pop() if _PRELOADED else load()
    return take


# (variable, minimum) of build_from_env's whole numbers
ENV_INTS = {"BITNET_THREADS": 1, "BITNET_PARALLEL": 1, "BITNET_CTX": 1, "BITNET_MAX_QUEUE": 0, "BITNET_REPLICAS": 1,
            "BITNET_BATCH_SIZE": 1}


def _env_int(name, default):
    v = os.environ.get(name)
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or n < ENV_INTS[name]:
        raise BitNetError(f"{name}={v!r}: must be a whole number >= {ENV_INTS[name]}")
    return n


def _env_model() -> str | None:
    """BITNET_MODEL, resolved and opened here as `bitnet serve --ray-replicas` does -m: a missing or unreadable
    model is one BitNetError naming the variable (each replica's load failed with its own traceback, and the
    message named -m/--model). The value itself goes to the replicas, which may run on other machines."""
    model = os.environ.get("BITNET_MODEL") or None
    from ..engine.api import resolve_store
    try:
        resolve_store(model, progress=False)
    except BitNetError as e:
        why = str(e.args[0]) if e.args else type(e).__name__
        for head in (f"model {model!r} (-m/--model): ", f"{model}: ", f"{model!r}: "):
            if model is not None and why.startswith(head):
                why = why[len(head):]
                break
        raise BitNetError(f"BITNET_MODEL={model!r}: {why.replace(' (-m/--model)', '')}", hint=e.hint) from None
    return model


def _cores_warning(replicas: int, threads: int) -> str | None:
    """BITNET_REPLICAS x BITNET_THREADS past this machine's cores, said as `bitnet serve --ray-replicas` says its
    flags'; a warning only: `serve run` may deploy on a cluster of several machines, where the replicas spread."""
    from ..engine.cpu import available_cores
    cores = available_cores()
    if replicas * threads <= cores:
        return None
    return (f"BITNET_REPLICAS={replicas} x BITNET_THREADS={threads} is {replicas * threads} engine threads, more than "
            f"the {cores} CPU cores of this machine: replicas placed here wait for each other's cores "
            f"(at most {cores} replicas of 1 thread fit)")


def build_from_env():
    """The application `serve run bitnet_cpu.serve.ray_app:app` deploys, from the BITNET_* variables. A bad value
    raises BitNetError, its message one line naming the variable; BITNET_REPLICAS x BITNET_THREADS past the
    cores is a warning on stderr."""
    import sys
    threads, replicas = _env_int("BITNET_THREADS", 1), _env_int("BITNET_REPLICAS", 2)
    parallel, ctx = _env_int("BITNET_PARALLEL", 16), _env_int("BITNET_CTX", None)
    max_queue, batch_size = _env_int("BITNET_MAX_QUEUE", 64), _env_int("BITNET_BATCH_SIZE", None)
    model = _env_model()
    warning = _cores_warning(replicas, threads)
    if warning:
        print(f"bitnet: warning: {warning}", file=sys.stderr, flush=True)
    return build(model, threads=threads, parallel=parallel, ctx=ctx, max_queue=max_queue,
                 api_key=os.environ.get("BITNET_API_KEY") or None, replicas=replicas, batch_size=batch_size)


def __getattr__(name):
    """`app`, built when `serve run` looks it up, not when the module is imported (`bitnet serve --ray-replicas`
    imports it too, and a stray BITNET_REPLICAS=x stopped it with an internal error)."""
    if name == "app":
        return build_from_env()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PROXY_WAIT_S = 300   # how long `bitnet serve --ray-replicas` waits for Serve's HTTP proxy to come up


def _lengthen_proxy_wait() -> None:
    """Serve's driver-side wait for its proxy is a module constant read at each call (ray.serve._private: api,
    client); raise it to PROXY_WAIT_S where it is still there and lower. A Ray that moved or renamed it keeps
    its own 60 s: only a slow start is affected, never a result."""
    try:
        from ray.serve._private import api as serve_api, client as serve_client
    except ImportError:
        return
    for mod in (serve_api, serve_client):
        wait = getattr(mod, "HTTP_PROXY_TIMEOUT", None)
        if isinstance(wait, (int, float)) and wait < PROXY_WAIT_S:
            mod.HTTP_PROXY_TIMEOUT = PROXY_WAIT_S


def _become_subreaper() -> bool:
    """Linux: processes orphaned below this one (the raylet's agents when the raylet dies first) become its
    children instead of init's, so that _end_leftovers still finds them. False where it cannot be set."""
    if not os.path.isdir("/proc"):
        return False
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _descendants(pid: int) -> set:
    """The live processes below pid (from /proc: empty where there is none), zombies left out."""
    parents, state = {}, {}
    with contextlib.suppress(OSError):
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat", "rb") as f:   # bytes: a command name is any bytes
                        fields = f.read().rsplit(b")", 1)[1].split()
                    state[int(d)], parents[int(d)] = fields[0].decode("ascii", "replace"), int(fields[1])
                except (OSError, IndexError, ValueError):
                    pass
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p} - out
        todo.extend(kids)
        out |= kids
    return {p for p in out if state.get(p) != "Z"}


def _reap(pids) -> None:
    for p in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(p, os.WNOHANG)


def _end_leftovers(bound_s: float = 15.0) -> None:
    """After ray.shutdown(): every process Ray started that still runs below this one (a start cut short by a
    signal left the raylet's DashboardAgent and RuntimeEnvAgent running for a minute after bitnet had exited) is
    sent SIGTERM, then SIGKILL after bound_s, and reaped. Only this process's own descendants are touched."""
    import signal
    import time
    left = _descendants(os.getpid())
    for p in left:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + bound_s
    while left and time.monotonic() < deadline:
        _reap(left)
        left &= _descendants(os.getpid())
        if left:
            time.sleep(0.05)
    for p in left:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    while left and time.monotonic() < deadline + bound_s:   # SIGKILL: gone at once, reaped here
        _reap(left)
        left &= _descendants(os.getpid())
        if left:
            time.sleep(0.05)


def _quiet_ray_output(stopping) -> None:
    """Ray's driver-side chatter that says nothing to a bitnet user: Serve's INFO lines ("New http_options ...
    will not be applied" after bitnet had itself started Serve with --host/--port) and, once bitnet stops, the
    raylet's report of the Serve controller that Serve's own shutdown killed. Warnings and errors stay."""
    import logging
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        from ray._private import worker as ray_worker
    except ImportError:
        return
    shown = getattr(ray_worker, "print_to_stdstream", None)
    if shown is None or getattr(shown, "_bitnet_quiet", False):
        return

    def filtered(data, *args, **kwargs):
        lines = data.get("lines") or () if isinstance(data, dict) else ()
        if stopping() and data.get("pid") == "raylet" and lines and all(
                "ServeController." in ln and "ray.kill" in ln for ln in lines):
            return None
        return shown(data, *args, **kwargs)
    filtered._bitnet_quiet = True
    ray_worker.print_to_stdstream = filtered


class _StoppedStarting(BaseException):
    """Ctrl-C / SIGTERM while Ray or Serve starts (a BaseException: Ray's `except Exception` lets it through)."""

    def __init__(self, sig: int):
        super().__init__(sig)
        self.sig = sig


def run_ray(args, sampling=None, api_keys: tuple = (), limits=None, sock=None) -> int:
    """`bitnet serve --ray-replicas N`: a private local Ray instance, started here and stopped here with
    everything it ran (a Ray cluster already on the machine, or named by RAY_ADDRESS, is never joined: it served
    on that cluster's port and its stop shut down every Serve app there), the deployment on host:port,
    Ctrl-C/SIGTERM stop; sampling: the server-wide SamplingParams defaults (from the command's flags);
    args.model: a store the CLI has resolved and opened. A signal during the start stops Ray and returns
    128 + its number (Ray's start only polls, so it was waited out: minutes, or for ever when the replicas never
    came up). HTTP reaches Ray Serve's proxy (on a private loopback port) through the front of serve/ray_front.py
    on host:port (`sock`, bound by the caller; here when None), with the plain server's connection limits."""
    import signal
    import sys
    import threading

    import ray

    stop = threading.Event()
    starting = [True]
    fronts, stops = [], []   # the front once made; the signals that came while stopping

    def on_signal(sig, frame):
        if stop.is_set() and fronts and fronts[0].stopping:   # as the plain server: a second signal brings the
            stops.append(sig)                                    # drain's deadline to now, a third stops at once
            fronts[0].hurry(force=len(stops) >= 2)
            return
        stop.set()
        if starting[0]:
            starting[0] = False   # once: Ray's shutdown below is not interrupted in turn
            raise _StoppedStarting(sig)

    def on_stop_signals():
        """Put in place again after each of Ray's starts: ray.init() sets its own SIGTERM handler, which aborted
        the process (-6) and left Ray's agents orphaned."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
    on_stop_signals()
    # Serve gives its HTTP proxy 5 s to report ready, three times, then kills it, and its driver waits a fixed
    # 60 s (HTTP_PROXY_TIMEOUT, no setting) for the proxy: on a 2-core machine with every core busy (load 4.5)
    # the proxy's imports alone took 56 s, and `serve.start` failed either way ("Ray Serve did not start"). A
    # local server waits for its proxy rather than giving up: a proxy that dies is reported at once anyway, so
    # the long wait only ever serves a slow one. The raylet and so every worker inherit the variables from this
    # process; a value the user set wins.
    for var in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(var, str(PROXY_WAIT_S))
    # Ray's GCS, raylet and agents listen on every interface whatever --host says (Ray has no setting to bind them
    # to loopback): a ray.init() instance authenticates them with a token from Ray 2.59 on (the cluster extra's
    # minimum; RAY_AUTH_MODE=token set here instead broke that start on 2.60). No colour codes in Ray's lines.
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    # Ray's proxy binds its port with SO_REUSEPORT by default: a second server that picked the same private port
    # listened on it too, and the kernel spread one front's requests (their keys) across both deployments.
    # Without it such a collision fails loudly ("Ray Serve did not start")
    os.environ.setdefault("SERVE_SOCKET_REUSE_PORT_ENABLED", "0")
    address = os.environ.pop("RAY_ADDRESS", None)   # workers inherit the environment: not theirs either
    if address:
        print(f"bitnet serve: warning: RAY_ADDRESS={address} is not used: --ray-replicas starts a Ray instance of "
              "its own on this machine (to deploy on that cluster: serve run bitnet_cpu.serve.ray_app:app)",
              file=sys.stderr, flush=True)
    _lengthen_proxy_wait()
    _become_subreaper()
    _quiet_ray_output(stop.is_set)
    from .limits import Limits
    from .ray_front import Front, listen, private_port, replica_limits
    limits = limits or Limits()
    if sock is None:
        try:
            sock = listen(args.host, args.port)
        except OSError as e:
            raise BitNetError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    proxy_port = [0]   # chosen right before Serve's proxy binds it: the later, the less time for another to
    front = Front(sock, lambda: f"http://127.0.0.1:{proxy_port[0]}", limits,   # take it
                  keep_alive=args.keep_alive_timeout, drain_s=args.drain_timeout, log_level=args.log_level,
                  on_exit=stop.set)
    fronts.append(front)
    try:
        front.start()   # answers 503 + Retry-After until the replicas are up, as the plain server while it loads
        try:
            # address="local": always a new instance, never a cluster found on the machine
            ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        except SystemExit as e:   # ray.init's own SIGTERM handler, in place while it runs: sys.exit(signum)
            if e.code != signal.SIGTERM:
                raise
            raise _StoppedStarting(signal.SIGTERM) from None
        except Exception as e:   # Ray's own start (its GCS, raylet, a RAY_ADDRESS that answers nothing): not our bug
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise BitNetError(f"Ray did not start: {first[:300]}",
                              hint="check `ray start --head` works on this machine, or serve without --ray-replicas"
                              ) from e
        on_stop_signals()
        _quiet_ray_output(stop.is_set)
        if front.failed:   # the front died while Ray started: no listener, nothing to serve
            return 1
        try:
            # Ray's proxy on loopback, reached only through the front on --host/--port
            proxy_port[0] = private_port()
            serve.start(http_options={"host": "127.0.0.1", "port": proxy_port[0]})
        except Exception as e:   # its controller or HTTP proxy actor died (a machine out of memory, a lost port)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise BitNetError(f"Ray Serve did not start: {first[:300]}",
                              hint="see Ray's logs under /tmp/ray/session_latest/logs") from e
        on_stop_signals()
        if front.failed:
            return 1
        from ..engine.runtime.speculative import lookup_from_flags
        from .auth import is_loopback

        application = build(args.model, threads=args.threads or 1, parallel=args.parallel, ctx=args.ctx,
                            max_queue=args.max_queue, api_key=args.api_key, replicas=args.ray_replicas, kv=args.kv,
                            lookup=lookup_from_flags(args.draft_max, args.lookup_ngram_min),
                            sampling=sampling, mmap=args.mmap, alias=args.alias,
                            strict_model=args.strict_model_name, api_keys=api_keys, limits=replica_limits(limits),
                            metrics_public=args.metrics_public, cors_origins=tuple(args.cors_origin or ()),
                            chat_template=getattr(args, "chat_template_text", None),
                            chat_template_source=getattr(args, "chat_template_flag", None),
                            template_kwargs=getattr(args, "template_kwargs", None),
                            reasoning_format=args.reasoning_format, batch_size=args.batch_size,
                            pooling=args.pooling, embd_normalize=args.embd_normalize,
                            local_only=is_loopback(args.host), webui=not args.no_webui)
        try:
            handle = serve.run(application, name="bitnet", route_prefix="/", blocking=False)
        except Exception as e:   # the deployment failed: its replicas' constructors raised (the model's load)
            text = str(e)
            with contextlib.suppress(Exception):   # the reason is in the deployment's status, not in `e`
                text += "\n" + "\n".join(d.message for d in serve.status().applications["bitnet"].deployments.values())
            if LOAD_FAILED in text:
                why = text[text.index(LOAD_FAILED) + len(LOAD_FAILED):].splitlines()[0]
                raise BitNetError(f"the model did not load on Ray's replicas: {why[:300]}") from e
            first = (text.strip().splitlines() or [type(e).__name__])[0]
            raise BitNetError(f"Ray Serve could not deploy the model: {first[:300]}",
                              hint="see Ray's logs under /tmp/ray/session_latest/logs/serve") from e
        with contextlib.suppress(Exception):   # as the plain server prints them; one replica's, all load alike
            for w in handle.warnings.remote().result(timeout_s=60):
                print(f"bitnet serve: warning: {w}", file=sys.stderr, flush=True)
        starting[0] = False
        front.ready.set()
        print(f"bitnet serve: {args.ray_replicas} Ray Serve replicas on http://{args.host}:{args.port}",
              file=sys.stderr, flush=True)
        stop.wait()
    except _StoppedStarting as e:
        print("bitnet serve: stopped while Ray Serve was starting", file=sys.stderr, flush=True)
        return 128 + e.sig
    finally:
        starting[0] = False
        stop.set()   # from here Ray's reports of what the shutdown kills are expected, not news
        with contextlib.suppress(Exception):   # first: requests in flight get --drain-timeout, then Serve and Ray
            front.stop()
        # only where Ray is up (always the instance started above: address="local"): serve.shutdown() without a
        # client looks one up, which started a second, complete local Ray (24-30 s, agents once left behind) when
        # a signal had cut ray.init() short
        if ray.is_initialized():
            with contextlib.suppress(Exception):   # Serve never started: nothing to shut down
                serve.shutdown()
        try:
            ray.shutdown()
        finally:   # a shutdown that failed leaves the most behind
            _end_leftovers()
    if front.failed:   # its line is printed: no listener was left, so the server stopped with it
        return 1
    print("bitnet serve: stopped", file=sys.stderr)
    return 0
