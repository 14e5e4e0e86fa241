"""Can we listen on this address? The one check the demo, its example script and `rolldiff demo` share.

`check_address(host, port)` refuses, before anything loads, what `launch` could not serve on: a port outside
1..65535, an empty host, a mistyped IPv4 address ("999.1.1.1" is not looked up as a name), a name this machine
cannot resolve, an address that is not this machine's, a port in use. It binds and releases the address the way
the server will (`SO_REUSEADDR`), so what it accepts the server can bind a moment later.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any


def check_address(host: Any, port: Any, bind: bool = True) -> None:
    """Refuse, with a ValueError naming `host` or `port`, an address the demo could not serve on; `bind=False` where
    other machines bind it (a joined Ray cluster's nodes): its form only, not whether this machine can."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"`port` must be a whole number from 1 to 65535, got {port!r}.")
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"`host` must be an address of this machine such as 127.0.0.1 or 0.0.0.0, got {host!r}.")
    if re.fullmatch(r"[\d.]+", host):  # looks like IPv4: must be one (no name lookup for "999.1.1.1")
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"`host` {host!r} is not a valid IPv4 address (four numbers 0-255).") from None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: a name idna cannot encode (a label > 63 chars)
        raise ValueError(f"`host` {host!r} is not an address or a name this machine can resolve ({exc}).") from None
    if not bind:
        return
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        try:
            probe.bind(address)
        except OSError as exc:
            raise ValueError(
                f"cannot serve on `host` {host!r} `port` {port}: {exc.strerror or exc}. Use a free port, and an "
                "address of this machine (127.0.0.1 for this machine only, 0.0.0.0 for every network)."
            ) from None


def launch(demo, host: str = "127.0.0.1", port: int = 7860, **launch_kwargs: Any):
    """Serve `demo` (a `gr.Blocks`) on `host:port` after checking the address (a ValueError before anything
    starts); `launch_kwargs` go to `demo.launch`."""
    check_address(host, port)
    return demo.launch(server_name=host, server_port=port, **launch_kwargs)
