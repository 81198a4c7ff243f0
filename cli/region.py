"""`shoal region --listen HOST:PORT --origin URL --store DIR [--config FILE]`."""

from __future__ import annotations

import argparse
import logging
import signal

from shoal.errors import ShoalError, UsageError

log = logging.getLogger("shoal.region")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "region",
        help="run the region cache in front of an origin registry",
        description=(
            "Serve registry blobs (GET/HEAD /v2/NAME/blobs/DIGEST, with byte ranges) from a region cache "
            "that reads through from the origin registry: one origin fetch per blob however many clients "
            "ask at once, every blob verified before it is cached, and private blobs served only to "
            "clients the origin would serve. Nodes use it as a fetch source; containerd can use it as a "
            "hosts.toml mirror. GET /-/status shows its counters."
        ),
        epilog="The configuration file (TOML) and its defaults are described in docs/cache.md.",
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="address to serve on (default 127.0.0.1:5080)")
    p.add_argument("--origin", metavar="URL", help="the origin registry, e.g. https://registry.example.com")
    p.add_argument("--store", metavar="DIR", help="the disk backend's folder (default /var/lib/shoal/region)")
    p.add_argument("--config", metavar="FILE", help="TOML configuration (flags win over it)")
    p.add_argument("--backend", choices=["disk", "s3"], help="where blobs are kept (default disk)")
    p.add_argument("--plain-http", action="store_true", default=None,
                   help="serve plain HTTP instead of HTTPS (loopback listen addresses only: demos and tests)")
    p.add_argument("--node-token", metavar="NAME",
                   help="print node NAME's own token (made from the region's node secret, which is made if "
                        "missing) and exit: the line for that node's [fetch] region_token_file; it speaks "
                        "for NAME alone (docs/security.md)")
    p.set_defaults(func=cmd_region)


def cmd_region(args: argparse.Namespace) -> int:
    from cache.region import backends  # (here: every other command starts without them)
    from cache.region.config import load_config

    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ShoalError("the region cache needs aiohttp: install shoal with the node extras "
                         "(pip install 'shoal[node]')") from None
    config = load_config(args.config, listen=args.listen, origin=args.origin, store=args.store,
                         backend=args.backend, plain_http=args.plain_http)
    if args.node_token is not None:
        return _print_node_token(config, args.node_token)
    host, port = config.listen_address
    logging.getLogger("shoal").setLevel(min(logging.getLogger("shoal").getEffectiveLevel(), logging.INFO))
    try:
        backend = backends.create(config.backend, **config.backend_options())
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except ImportError as exc:
        raise ShoalError(f"backend {config.backend} needs {exc.name}: install shoal with the node extras "
                         "(pip install 'shoal[node]')") from None
    except OSError as exc:
        raise ShoalError(f"store {config.store}: {exc.strerror or exc}") from None
    tls = None
    if not config.plain_http:
        from cache.region.tls import RegionTLS, ensure_region_tls

        try:
            if config.tls_cert:
                tls = RegionTLS("", config.tls_cert, config.tls_key)
            else:
                tls = ensure_region_tls(config.state_dir, host, config.tls_names)
            tls.server_context()  # a bad key or certificate: one line now
        except OSError as exc:
            raise ShoalError(f"region TLS in {config.state_dir}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ShoalError(f"region TLS certificate {tls.cert if tls else config.state_dir}: {exc}") from None
    from cache.region.tls import ensure_node_token

    try:
        token = ensure_node_token(config.token_path)
        prefetch_token = ensure_node_token(config.prefetch_token_path)
    except OSError as exc:
        raise ShoalError(f"region token: {exc.strerror or exc}") from None
    import asyncio

    return asyncio.run(_serve(config, backend, host, port, tls, token, prefetch_token))


def _print_node_token(config, name: str) -> int:
    from cache.region.tls import NODE_NAME_RE, NodeTokens, ensure_node_token

    if not NODE_NAME_RE.match(name):
        raise UsageError(f"--node-token: {name[:80]!r} is not a node name (letters, digits, '.', '_', '-')")
    try:
        secret = ensure_node_token(config.token_path)
    except OSError as exc:
        raise ShoalError(f"region node secret {config.token_path}: {exc.strerror or exc}") from None
    if name in config.nodes.revoked:
        log.warning("node %s is in [nodes] revoked: the region refuses this token", name)
    print(NodeTokens(secret).token_for(name))
    return 0


async def _serve(config, backend, host: str, port: int, tls, token: str, prefetch_token: str) -> int:
    from region.service import start_region

    try:
        server = await start_region(config, backend, host, port, tls=tls, node_token=token,
                                    prefetch_token=prefetch_token)
    except OSError as exc:
        raise ShoalError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    import asyncio

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # one line for people and scripts that wait for it
    scheme = "https" if tls else "http"
    print(f"shoal region: serving {config.origin} on {scheme}://{host}:{server.port} ({config.backend} backend)",
          flush=True)
    if tls is not None and tls.ca:
        log.info("nodes pin the region's CA certificate %s ([fetch] region_ca)", tls.ca)
    log.info("nodes present the token in %s ([fetch] region_token_file)", config.token_path)
    log.info("the preheat API (shoal prefetch --region) takes the token in %s", config.prefetch_token_path)
    await stop.wait()
    log.info("stopping")
    await server.stop()
    return 0
