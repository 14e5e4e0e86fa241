"""Real-time sessions over the network: `rolldiff serve` (the server, `pip install "rolldiff[serve]"`) and its
Python client. One protocol, `rolldiff-stream/1` (docs/serving.md): JSON control messages, binary frames.

    connect(url, prompt=..., **start) -> RemoteStream   iterate chunks; switch_prompt, send_frames, suspend, close
    restore(url, token) -> RemoteStream                 continue a suspended session
"""

from .client import RemoteStream, connect, restore
from .protocol import PROTOCOL, ProtocolError

__all__ = ["PROTOCOL", "ProtocolError", "RemoteStream", "connect", "restore"]
