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
    # the Ray proxy's to bound (bitnet serve refuses those flags beside --ray-replicas)
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
            _preload(load)

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


def _preload(load) -> None:
    try:
        _PRELOADED[:] = [load()]
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


def build_from_env():
    """The application `serve run bitnet_cpu.serve.ray_app:app` deploys, from the BITNET_* variables. A bad value
    raises BitNetError, its message one line naming the variable."""
    return build(os.environ.get("BITNET_MODEL") or None, threads=_env_int("BITNET_THREADS", 1),
                 parallel=_env_int("BITNET_PARALLEL", 16), ctx=_env_int("BITNET_CTX", None),
                 max_queue=_env_int("BITNET_MAX_QUEUE", 64), api_key=os.environ.get("BITNET_API_KEY") or None,
                 replicas=_env_int("BITNET_REPLICAS", 2), batch_size=_env_int("BITNET_BATCH_SIZE", None))


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


class _StoppedStarting(BaseException):
    """Ctrl-C / SIGTERM while Ray or Serve starts (a BaseException: Ray's `except Exception` lets it through)."""

    def __init__(self, sig: int):
        super().__init__(sig)
        self.sig = sig


def run_ray(args, sampling=None, api_keys: tuple = (), limits=None) -> int:
    """`bitnet serve --ray-replicas N`: a local Ray instance, the deployment on host:port, Ctrl-C/SIGTERM stop;
    sampling: the server-wide SamplingParams defaults (from the command's flags); args.model: a store the CLI
    has resolved and opened. A signal during the start stops Ray and returns 128 + its number (Ray's start
    only polls, so it was waited out: minutes, or for ever when the replicas never came up)."""
    import signal
    import sys
    import threading

    import ray

    stop = threading.Event()
    starting = [True]

    def on_signal(sig, frame):
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
    _lengthen_proxy_wait()
    try:
        try:
            ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
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
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
        except Exception as e:   # its controller or HTTP proxy actor died (a machine out of memory, a lost port)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise BitNetError(f"Ray Serve did not start: {first[:300]}",
                              hint="see Ray's logs under /tmp/ray/session_latest/logs") from e
        on_stop_signals()
        from ..engine.runtime.speculative import lookup_from_flags
        from .auth import is_loopback

        application = build(args.model, threads=args.threads or 1, parallel=args.parallel, ctx=args.ctx,
                            max_queue=args.max_queue, api_key=args.api_key, replicas=args.ray_replicas, kv=args.kv,
                            lookup=lookup_from_flags(args.draft_max, args.lookup_ngram_min),
                            sampling=sampling, mmap=args.mmap, alias=args.alias,
                            strict_model=args.strict_model_name, api_keys=api_keys, limits=limits,
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
        print(f"bitnet serve: {args.ray_replicas} Ray Serve replicas on http://{args.host}:{args.port}",
              file=sys.stderr, flush=True)
        stop.wait()
    except _StoppedStarting as e:
        print("bitnet serve: stopped while Ray Serve was starting", file=sys.stderr, flush=True)
        return 128 + e.sig
    finally:
        starting[0] = False
        # only where Ray is up: serve.shutdown() without a client looks one up, which started a second, complete
        # local Ray (24-30 s, agents once left behind) when a signal had cut ray.init() short
        if ray.is_initialized():
            with contextlib.suppress(Exception):   # Serve never started: nothing to shut down
                serve.shutdown()
        ray.shutdown()
    print("bitnet serve: stopped", file=sys.stderr)
    return 0
