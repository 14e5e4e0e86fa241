"""rolldiff's nodes for ComfyUI: load a pipeline, make a video as images, or write a long one straight to an mp4.

ComfyUI loads custom nodes from folders in its `custom_nodes/` whose `__init__.py` defines `NODE_CLASS_MAPPINGS`;
`rolldiff install-comfyui COMFYUI_FOLDER` writes such a folder, importing these from the installed package (so
`pip install -U rolldiff` updates the nodes). See docs/comfyui.md.
"""

from .nodes import RolldiffLoadPipeline, RolldiffVideo, RolldiffVideoToFile

NODE_CLASS_MAPPINGS = {
    "RolldiffLoadPipeline": RolldiffLoadPipeline,
    "RolldiffVideo": RolldiffVideo,
    "RolldiffVideoToFile": RolldiffVideoToFile,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "RolldiffLoadPipeline": "Load rolldiff Pipeline",
    "RolldiffVideo": "rolldiff Video",
    "RolldiffVideoToFile": "rolldiff Video to File",
}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
