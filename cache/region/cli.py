"""`shoal region --listen HOST:PORT --origin URL --store DIR [--config FILE]`."""

from __future__ import annotations

import argparse
import logging
import signal

from cache.region import backends
from cache.region.config import load_config
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
    p.set_defaults(func=cmd_region)


def cmd_region(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ShoalError("the region cache needs aiohttp: install shoal with the node extras "
                         "(pip install 'shoal[node]')") from None
    config = load_config(args.config, listen=args.listen, origin=args.origin, store=args.store,
                         backend=args.backend)
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
    import asyncio

    return asyncio.run(_serve(config, backend, host, port))


async def _serve(config, backend, host: str, port: int) -> int:
    from cache.region.server import start_server

    try:
        server = await start_server(config, backend, host, port)
    except OSError as exc:
        raise ShoalError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    import asyncio

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # one line for people and scripts that wait for it
    print(f"shoal region: serving {config.origin} on http://{host}:{server.port} ({config.backend} backend)", flush=True)
    await stop.wait()
    log.info("stopping")
    await server.stop()
    return 0
