"""`tandem serve` (the engine behind SGLang's HTTP API), `tandem router` (one such endpoint in front of several
servers), `tandem run` (the RL loop on the random agent), `tandem export RUN_DIR OUT_DIR` (a run's policy as a Hugging
Face checkpoint), `tandem plot RUN_DIR` (charts of its metrics) and `tandem analyze DUMP_DIR` (which rank hung where,
from the flight recorders' files)."""

from __future__ import annotations

import argparse
import faulthandler
import ipaddress
import logging
import os
import signal
import sys
from typing import get_args

from tandem.config import Dtype, EngineConfig, HostCache, HostCacheCopy


def _serve(args) -> None:
    from tandem.config import resolve_model
    from tandem.distributed.parallel import SINGLE
    from tandem.distributed.watchdog import install_handlers
    from tandem.engine.engine import Engine
    from tandem.run.tp import await_followers, init_tp, rendezvous_store, start_followers
    from tandem.server.http import serve

    options = _server_options(args)
    config = EngineConfig(page_size=args.page_size, num_pages=args.num_pages,
                          max_running_requests=args.max_running_requests,
                          max_prefill_tokens=args.max_prefill_tokens, device=args.device,
                          enable_prefix_cache=not args.disable_prefix_cache, seed=args.seed,
                          host_cache=args.host_cache, host_cache_pages=args.host_cache_pages,
                          host_cache_copy=args.host_cache_copy,
                          token_broadcast=not args.no_token_broadcast, dump_dir=args.dump_dir,
                          watchdog_timeout_s=args.watchdog_timeout, role=args.role)
    if args.role != "unified" and args.tp * args.ep > 1:
        raise ValueError(f"--role {args.role}: prefill/decode servers run on one rank for now (no --tp or --ep)")
    if args.tp < 1 or args.ep < 1:
        raise ValueError(f"--tp and --ep must be at least 1, got --tp {args.tp} --ep {args.ep}")
    if args.ep > 1:
        model_config = resolve_model(args.model)[0]
        if not model_config.is_moe:
            raise ValueError(f"--ep {args.ep}: expert parallelism splits experts, and {args.model} has none")
        if model_config.num_experts % args.ep:
            raise ValueError(f"--ep {args.ep}: must divide the model's num_experts ({model_config.num_experts})")
    tp, followers, size = SINGLE, [], args.tp * args.ep
    if size > 1:  # ranks 1.. in their own processes; this one is rank 0 and serves
        store = rendezvous_store()
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        followers = start_followers(size, store, backend, args.model, config, args.dtype, args.seed, ep=args.ep)
        await_followers(store, followers)
        tp = init_tp(0, size, store, backend, ep=args.ep)
    engine = Engine(args.model, config, dtype=args.dtype, seed=args.seed, tp=tp)
    install_handlers(engine.watchdog)  # `kill -USR1 PID` dumps the flight recorder and every thread's stack
    mc = engine.model_config
    params = sum(p.numel() for p in engine.model.parameters())
    logging.info("model %s: %d layers, hidden %d, vocab %d, %.1fM parameters, %s on %s", args.model,
                 mc.num_hidden_layers, mc.hidden_size, mc.vocab_size, params / 1e6, args.dtype, args.device)
    try:
        serve(engine, host=args.host, port=args.port, options=options)
    finally:
        engine.shutdown()  # tells the followers to stop
        for p in followers:
            p.join(timeout=30)


def _server_options(args):
    """The server's keys and limits from the arguments (keys also from TANDEM_API_KEY, TANDEM_ADMIN_API_KEY);
    ValueError for binding beyond loopback without a key, unless allowed explicitly."""
    from tandem.server.guard import ServerOptions

    api_key = args.api_key or os.environ.get("TANDEM_API_KEY") or None
    admin_key = args.admin_api_key or os.environ.get("TANDEM_ADMIN_API_KEY") or None
    weight_dirs = args.weight_dir if args.weight_dir is not None else [args.model] if os.path.isdir(args.model) else []
    if not _is_loopback(args.host) and api_key is None:
        if not args.allow_unauthenticated:
            raise ValueError(f"--host {args.host}: binding beyond loopback lets anyone who reaches the port pause, "
                             "load weights or abort everything; give --api-key (or TANDEM_API_KEY), or "
                             "--allow-unauthenticated")
        logging.warning("serving on %s without an API key (--allow-unauthenticated): anyone who reaches the port "
                        "controls the engine", args.host)
    return ServerOptions(api_key=api_key, admin_api_key=admin_key, max_body_bytes=args.max_body_bytes,
                         weight_dirs=tuple(weight_dirs))


def _router(args) -> None:
    from tandem.server.router import RouterConfig, serve_router

    options = _server_options(args)
    config = RouterConfig(
        servers=tuple(args.server or ()), prefill=tuple(args.prefill or ()), decode=tuple(args.decode or ()),
        backend_api_key=args.backend_api_key or os.environ.get("TANDEM_BACKEND_API_KEY") or None,
        backend_admin_api_key=args.backend_admin_api_key or os.environ.get("TANDEM_BACKEND_ADMIN_API_KEY") or None,
        connect_timeout_s=args.connect_timeout)
    for role in ("servers", "prefill", "decode"):
        if getattr(config, role):
            logging.info("routing to %s: %s", role, " ".join(getattr(config, role)))
    serve_router(config, host=args.host, port=args.port, options=options)


def _access_arguments(parser: argparse.ArgumentParser) -> None:
    """The keys and limits a server and a router share (read by `_server_options`)."""
    parser.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' on every endpoint "
                        "but /health (or TANDEM_API_KEY)")
    parser.add_argument("--admin-api-key", default=None, help="required instead on the admin endpoints (pause, "
                        "weights, weight groups, flush, abort all; or TANDEM_ADMIN_API_KEY)")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="allow --host beyond loopback without an API key")
    parser.add_argument("--max-body-bytes", type=int, default=64 << 20, help="larger request bodies get a 413")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _run(args) -> None:
    from tandem.run.main import Interrupted
    from tandem.run.main import main as run_main

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack on stderr
    try:
        run_main(args.config, args.overrides)
    except Interrupted as e:  # not a success: a script running it must see that
        sys.exit(e.exit_code)


def _export(args) -> None:
    from tandem.run.export import CHECKPOINT, export_run, parse_size

    exported = export_run(args.run_dir, args.out_dir, dtype=args.dtype, max_shard_bytes=parse_size(args.max_shard_size))
    print(f"exported {os.path.join(args.run_dir, CHECKPOINT)} (step {exported.version}) in {exported.dtype} to "
          f"{exported.out_dir}: {', '.join(exported.files)}")
    if exported.no_tokenizer:
        print(f"no tokenizer: {exported.no_tokenizer}")


def _plot(args) -> None:
    from tandem.plot import plot_run

    report = plot_run(args.run_dir, args.out)
    for path in report.written:
        print(f"wrote {path}")
    for line in report.skipped:
        print(f"skipped {line}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["analyze"]:  # the analyzer parses its own arguments
        from tandem.distributed.analyzer import main as analyze

        sys.exit(analyze(argv[1:]))
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("analyze", help="read the ranks' flight-recorder files and name the rank that hung")

    serve = sub.add_parser("serve", help="serve a model over SGLang's native HTTP API")
    serve.add_argument("--model", default="tiny", help="preset name or a directory with config.json")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--dtype", default="float32", choices=get_args(Dtype))
    serve.add_argument("--page-size", type=int, default=16)
    serve.add_argument("--num-pages", type=int, default=2048)
    serve.add_argument("--max-running-requests", type=int, default=64)
    serve.add_argument("--max-prefill-tokens", type=int, default=512)
    serve.add_argument("--disable-prefix-cache", action="store_true")
    serve.add_argument("--host-cache", default="off", choices=get_args(HostCache),
                       help="a host-memory tier under the prefix cache")
    serve.add_argument("--host-cache-pages", type=int, default=0, help="its size in pages (0: twice the device pool)")
    serve.add_argument("--host-cache-copy", default=EngineConfig().host_cache_copy, choices=get_args(HostCacheCopy),
                       help="how its copies move pages on CUDA (engine.host_cache_copy)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one process each)")
    serve.add_argument("--ep", type=int, default=1,
                       help="expert-parallel ranks of a mixture-of-experts model: the engine runs tp x ep ranks, "
                            "the experts split over ep of them, the dense layers over tp")
    serve.add_argument("--role", default="unified", choices=["unified", "prefill", "decode"],
                       help="prefill/decode disaggregation: a prefill server computes prompts for decode servers, "
                            "which take their KV (a router pairs them; see tandem.server.disagg)")
    serve.add_argument("--no-token-broadcast", action="store_true",
                       help="let every TP rank keep its own samples (risks divergence; the sentinel still checks)")
    serve.add_argument("--dump-dir", default=None, help="flight recorder journals and watchdog dumps go here")
    serve.add_argument("--watchdog-timeout", type=float, default=300.0, help="seconds without progress (0: off)")
    _access_arguments(serve)
    serve.add_argument("--weight-dir", action="append", default=None,
                       help="a directory /update_weights_from_disk may read (repeatable; default: --model's)")
    serve.set_defaults(fn=_serve)

    router = sub.add_parser("router", help="route SGLang's native HTTP API to several servers: replicas "
                            "(--server), or prefill and decode servers (--prefill, --decode)")
    router.add_argument("--server", nargs="+", metavar="URL", help="unified servers' base URLs (replicas)")
    router.add_argument("--prefill", nargs="+", metavar="URL", help="prefill servers' base URLs")
    router.add_argument("--decode", nargs="+", metavar="URL", help="decode servers' base URLs")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=30000)
    _access_arguments(router)
    router.add_argument("--backend-api-key", default=None,
                        help="sent to the servers as their client key (or TANDEM_BACKEND_API_KEY)")
    router.add_argument("--backend-admin-api-key", default=None, help="sent to the servers on admin calls: "
                        "pause, weights, flush, aborts (or TANDEM_BACKEND_ADMIN_API_KEY)")
    router.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a server")
    router.set_defaults(fn=_router, weight_dir=[])  # it loads no weights (_server_options); its servers check theirs

    run = sub.add_parser("run", help="run fully-async RL on the random agent (or another task)")
    run.add_argument("--config", default=None, help="a TOML run config; the embedded default if absent")
    run.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. rollout.max_staleness=2")
    run.set_defaults(fn=_run)

    export = sub.add_parser("export", help="write a run's policy (its newest checkpoint) as a Hugging Face "
                            "checkpoint: safetensors, config.json, generation_config.json and the tokenizer")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a tandem run's out_dir (holding checkpoint.pt)")
    export.add_argument("out_dir", metavar="OUT_DIR", help="where to write it (must not exist, or be empty)")
    export.add_argument("--dtype", default=None, choices=get_args(Dtype),
                        help="the weights' dtype (default: the one the run trained in, trainer.param_dtype)")
    export.add_argument("--max-shard-size", default="5GB", help="larger checkpoints are sharded, with an index")
    export.set_defaults(fn=_export)

    plot = sub.add_parser("plot", help="PNG charts of a run's metrics.jsonl (needs matplotlib: tandem-rl[plot])")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a tandem run's out_dir (holding metrics.jsonl)")
    plot.add_argument("--out", default=None, help="where to write the PNGs (default: RUN_DIR/plots)")
    plot.set_defaults(fn=_plot)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.fn(args)
    except ValueError as e:
        print(f"tandem {args.command}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
