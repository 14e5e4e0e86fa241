"""What the nodes use of ComfyUI when they run inside it: its device, its output folder, its progress bar and its
Cancel button. ComfyUI's modules (`comfy`, `folder_paths`) exist only in its process, so each is imported at call
time, and outside ComfyUI (scripts, tests) each falls back to the plain equivalent: the nodes run either way."""

from __future__ import annotations

from pathlib import Path


def default_device() -> str:
    """The device ComfyUI runs models on (its `--cpu`, `--cuda-device` honoured), else rolldiff's default."""
    try:
        from comfy.model_management import get_torch_device
    except ImportError:
        from ..defaults import default_device as rolldiff_default

        return rolldiff_default()
    return str(get_torch_device())


def output_folder() -> Path:
    """ComfyUI's output folder (where Save Video writes), else `./output`."""
    try:
        import folder_paths
    except ImportError:
        return Path.cwd() / "output"
    return Path(folder_paths.get_output_directory())


def lora_path(name: str) -> str:
    """A LoRA named as ComfyUI lists it (a file in `models/loras`) as its full path; any other name (a path, a Hub
    id) as given."""
    try:
        import folder_paths
    except ImportError:
        return name
    if Path(name).expanduser().exists():
        return name
    return folder_paths.get_full_path("loras", name) or name


def check_interrupted() -> None:
    """Raise ComfyUI's own interruption when its Cancel button was pressed; called between chunks."""
    try:
        from comfy.model_management import throw_exception_if_processing_interrupted
    except ImportError:
        return
    throw_exception_if_processing_interrupted()


class Progress:
    """ComfyUI's progress bar on the node (frames made out of the video's), or nothing outside ComfyUI."""

    def __init__(self, total_frames: int) -> None:
        try:
            from comfy.utils import ProgressBar
        except ImportError:
            self._bar = None
        else:
            self._bar = ProgressBar(total_frames)

    def frames_done(self, frames: int) -> None:
        if self._bar is not None:
            self._bar.update_absolute(frames)
