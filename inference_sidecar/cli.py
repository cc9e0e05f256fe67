"""Command line: ``inference-sidecar router ...`` and ``inference-sidecar cluster ...``
(the flags: ``arguments``).

``router`` serves the router in front of workers that already run; ``cluster`` starts
vLLM workers from a config, then the router in front of them, and stops everything on
Ctrl-C or SIGTERM. A number a flag cannot take (NaN, an infinity, a negative or zero
where the router needs more) stops the command at once with a message naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from inference_sidecar.arguments import ADMIN_TOKEN_ENV, LOAD_VIEW_ENV, build_parser
from inference_sidecar.config import (
    ADMIN_HOST,
    RouterConfig,
    Secret,
)
from inference_sidecar.exceptions import ConfigError, SidecarError
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.load_view import DEFAULT_LOAD_VIEW
from inference_sidecar.workers import ClusterConfig, WorkerProcesses, specs_summary
from intent_reader.config_errors import redact_url

log = logging.getLogger("inference_sidecar")


def router_config(args: argparse.Namespace, **overrides: Any) -> RouterConfig:
    kwargs: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "policy": args.policy,
        "load_factor": args.load_factor,
        "min_load_bound": args.min_load_bound,
        "residency_factor": args.residency_factor,
        "recompute_weight": args.recompute_weight,
        "request_cost": args.request_cost,
        "new_key_placement": args.new_key_placement,
        "load_view": load_view(args.load_view, os.environ),
        "load_poll_interval_s": args.load_poll_interval,
        "max_attempts": args.max_attempts,
        "request_timeout_s": args.request_timeout,
        "max_concurrent_requests": args.max_concurrent_requests,
        "health_interval_s": args.health_interval,
        "max_body_bytes": args.max_body_bytes,
        "body_timeout_s": args.body_timeout,
        "kv_stale_after_s": args.kv_stale_after,
        "tokenizer_workers": args.tokenizer_workers,
        "admin_port": args.admin_port,
        "admin_token": admin_token(args.admin_token_file, os.environ),
    }
    if args.key_headers:
        kwargs["key_headers"] = tuple(args.key_headers)
    kwargs.update(overrides)
    return RouterConfig(**kwargs)


def admin_token(path: Path | None, environ: Mapping[str, str]) -> Secret | None:
    """The admin token from ``path`` (surrounding blanks dropped), else from
    ``$SI_ROUTER_ADMIN_TOKEN``, else None (the admin routes stay off)."""
    if path is not None:
        try:
            return Secret(path.read_text().strip())
        except OSError as exc:
            raise ConfigError("admin_token_file", f"cannot read {path}: {exc}") from exc
    value = environ.get(ADMIN_TOKEN_ENV, "").strip()
    return Secret(value) if value else None


def load_view(flag: str | None, environ: Mapping[str, str]) -> str:
    """``--load-view`` if given, else ``$SI_ROUTER_LOAD_VIEW``, else the default; a value
    that is no view is refused by ``RouterConfig``."""
    if flag is not None:
        return flag
    value = environ.get(LOAD_VIEW_ENV, "").strip()
    return value or DEFAULT_LOAD_VIEW


def parse_kv_events(values: Sequence[str]) -> dict[str, EventSource]:
    """``URL=ENDPOINT[,REPLAY]`` options as the router's ``kv_events``."""
    sources: dict[str, EventSource] = {}
    for value in values:
        url, sep, rest = value.partition("=")
        endpoint, _, replay = rest.partition(",")
        if not sep or not url:
            raise ConfigError("kv_events", f"expected URL=tcp://host:port[,REPLAY], got {value!r}")
        sources[url] = EventSource(endpoint, replay or None)
    return sources


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The config file's settings, overridden by the flags given on the command line."""
    base = ClusterConfig.load(args.config) if args.config else ClusterConfig()
    overrides = {
        f.name: getattr(args, f.name)
        for f in fields(ClusterConfig)
        if getattr(args, f.name, None) is not None
    }
    values = {f.name: getattr(base, f.name) for f in fields(ClusterConfig)}
    config = ClusterConfig(**{**values, **overrides})
    if args.policy == "kv_prefix" and not config.kv_events:
        config = replace(config, kv_events=True)  # the policy needs the workers' events
    return config


def serve(config: RouterConfig, log_level: str) -> None:
    """Run the router until SIGINT/SIGTERM (uvicorn handles both). With an admin port,
    one server listens on both sockets and the app tells them apart."""
    import uvicorn

    from inference_sidecar.router import create_app

    log.info(
        "router on http://%s:%d (%s, policy %s, load view %s) -> %s",
        config.host,
        config.port,
        config.mode,
        config.policy,
        config.load_view,
        ", ".join(redact_url(u) for u in config.workers or (*config.prefill, *config.decode)),
    )
    options: dict[str, Any] = {
        "log_level": log_level,
        "access_log": log_level == "debug",
        "timeout_graceful_shutdown": 10,
    }
    if config.admin_port is None:
        uvicorn.run(create_app(config), host=config.host, port=config.port, **options)
        return
    log.info("admin routes on http://%s:%d", ADMIN_HOST, config.admin_port)
    sockets = [_bound(config.host, config.port), _bound(ADMIN_HOST, config.admin_port)]
    server = uvicorn.Server(uvicorn.Config(create_app(config), **options))
    server.run(sockets=sockets)


def _bound(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError("port", f"cannot listen on {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


def run_router(args: argparse.Namespace) -> int:
    config = router_config(
        args,
        workers=tuple(args.worker),
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        kv_events=parse_kv_events(args.kv_events),
        tokenizer_dir=args.tokenizer,
        max_model_len=args.max_model_len,
        kv_block_size=args.kv_block_size,
        kv_hash_algo=args.kv_hash_algo,
    )
    serve(config, args.log_level)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_cluster(args: argparse.Namespace) -> int:
    cfg = cluster_config(args)
    pool = WorkerProcesses(cfg, ready_timeout_s=args.ready_timeout)
    # SIGTERM while workers start must still stop them: turn it into KeyboardInterrupt.
    signal.signal(signal.SIGTERM, _interrupt)
    log.info("starting %d worker(s):\n%s", len(pool.specs), specs_summary(pool.specs))
    kv: dict[str, Any] = {}
    if cfg.kv_events:
        kv = {
            "kv_events": {
                url: EventSource(events, replay)
                for url, (events, replay) in pool.kv_event_sources.items()
            },
            "tokenizer_dir": str(pool.config.model_dir),
            "max_model_len": pool.config.max_model_len,
        }
    try:
        with pool:
            if cfg.mode == "aggregated":
                rc = router_config(args, workers=tuple(pool.worker_urls), **kv)
            else:
                rc = router_config(
                    args, prefill=tuple(pool.prefill_urls), decode=tuple(pool.decode_urls), **kv
                )
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # uvicorn installs its own
            serve(rc, args.log_level)
    except KeyboardInterrupt:
        log.info("interrupted; workers stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":  # httpx logs every request (health probes too) at info
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.command == "router":
            return run_router(args)
        return run_cluster(args)
    except SidecarError as exc:
        print(f"inference-sidecar: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
