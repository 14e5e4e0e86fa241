"""Spellings of argument values that the command line offers before anything heavy loads: one home each, shared by
the library, the command line and the demo. This module imports nothing, so `rolldiff --help` lists them without
importing torch."""

ALL_FRAMES = "all"  # `window_frames` of an unbounded window: every earlier frame stays visible
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes a pipeline loads in (`rolldiff.defaults.DTYPES`)
# Where a pipeline's weights wait between uses (`rolldiff.pipelines.memory.enable_offload`, `--offload`)
OFFLOAD_MODES = ("text-encoder", "model", "blocks")
