"""Flower's ``flower-superlink`` with less CPU per HTTP request.

Flower 1.41's SuperLink serves every Fleet, Runtime and Control request through nine
Starlette ``BaseHTTPMiddleware`` layers (error translation, protobuf translation, node
authentication, event logs, Control authentication and licence checks); each layer
runs the rest of the stack in its own anyio task group and streams the response through
its own wrapper, even where its ``dispatch`` only passes the request on. FastAPI then
runs each synchronous dependency of the route (the protobuf request, the LinkState, the
version check) in a worker thread. On a small machine that machinery, not the LinkState,
is most of a request's CPU time. This wrapper runs the unmodified ``flower-superlink``
command with

- Flower's middleware run as one layer: the same ``dispatch`` functions, in Flower's
  order, composed inside one ``BaseHTTPMiddleware`` (``client.protocol.http_app``), so every
  check, translation and log runs as before, with one task group per request;
- the dependencies that only read the request or the app's state
  (``trivial_http_dependencies``) called on the event loop; route handlers, the
  node-authentication check and every other dependency still run in worker threads.

TLS, SuperNode authentication, the access log and the log level are Flower's. Every
other argument goes to ``flower-superlink`` unchanged::

    python -m server.superlink -- --ssl-ca-certfile ca.pem ... --enable-supernode-auth
"""

from __future__ import annotations

import argparse
import sys

from client.protocol.flower_compat import replace_superlink_middleware, run_flower_superlink
from client.protocol.http_app import (
    add_http_options,
    inline_trivial_dependencies,
    merge_middleware,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m server.superlink", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_http_options(parser, "the SuperLink")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not args.stacked_middleware:
        replace_superlink_middleware(merge_middleware)
    if not args.threaded_dependencies:
        inline_trivial_dependencies()
    run_flower_superlink(rest[1:] if rest[:1] == ["--"] else rest)


if __name__ == "__main__":
    main()
