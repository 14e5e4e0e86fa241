"""Serve the rolldiff demo on this machine: `python examples/gradio_demo.py [PIPELINE_FOLDER_OR_HUB_ID]`.

With no argument it serves the embedded tiny model, which runs on a CPU. `rolldiff demo --help` has every option.
"""

import sys

from rolldiff.demo import build_demo

if __name__ == "__main__":
    demo = build_demo(sys.argv[1] if len(sys.argv) > 1 else None, max_concurrency=2)
    demo.launch(server_name="127.0.0.1", server_port=7860)
