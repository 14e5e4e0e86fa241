"""Spellings of argument values that the command line offers before anything heavy loads: one home each, shared by
the library, the command line and the demo. This module imports nothing, so `rolldiff --help` lists them without
importing torch."""

DEFAULT_MODEL_NAME = "tiny-bouncing-shapes"  # the embedded pipeline a call without a model loads
EMBEDDED_MODEL_NAMES = (
    DEFAULT_MODEL_NAME,
    "tiny-bouncing-shapes-sana",
)  # shipped in rolldiff/assets, the default first
DEFAULT_STRENGTH = 0.8  # how far `video=` input is noised by default: diffusers' WanVideoToVideoPipeline's
ALL_FRAMES = "all"  # `window_frames` of an unbounded window: every earlier frame stays visible
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes a pipeline loads in (`rolldiff.defaults.DTYPES`)
# Where a pipeline's weights wait between uses (`rolldiff.pipelines.memory.enable_offload`, `--offload`)
OFFLOAD_MODES = ("text-encoder", "model", "blocks")
