"""Serve the rolldiff demo on this machine: `python examples/gradio_demo.py [MODEL] [--host HOST] [--port PORT]`.

MODEL is an embedded model's name, a pipeline folder or a Hub id; without it the page offers every embedded
model (tiny, CPU-friendly). `rolldiff demo --help` has every option.
"""

import argparse

from rolldiff.demo import build_demo, check_address, launch

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="embedded model name, pipeline folder or Hub id")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default: this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    args = parser.parse_args()
    check_address(args.host, args.port)  # a bad host or port: a ValueError naming it, before the model loads
    demo = build_demo(args.model, max_concurrency=2)
    launch(demo, host=args.host, port=args.port)
