"""The folder ComfyUI loads rolldiff's nodes from: `custom_nodes/comfyui-rolldiff/__init__.py`, a two-line module
that imports the nodes from the rolldiff package installed in ComfyUI's Python environment, so upgrading the package
upgrades the nodes. ComfyUI names a custom node's module after its folder, which is why the folder is not called
`rolldiff` (that module would shadow the package itself)."""

from __future__ import annotations

from pathlib import Path

NODES_FOLDER = "comfyui-rolldiff"
_WRITTEN_BY = "written by `rolldiff install-comfyui`"
_MODULE = f'''"""rolldiff's ComfyUI nodes, from the rolldiff package in ComfyUI's Python environment ({_WRITTEN_BY})."""

from rolldiff.comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F401
'''


def install_nodes(comfyui_folder: str | Path) -> Path:
    """Write (or rewrite) the nodes' folder in `comfyui_folder`'s `custom_nodes`; returns its `__init__.py`.

    Raises:
        ValueError: naming `comfyui_folder` when it has no `custom_nodes` folder, or when the nodes' folder holds an
            `__init__.py` that this function did not write (it is left alone).
    """
    root = Path(comfyui_folder).expanduser()
    custom_nodes = root / "custom_nodes"
    if not custom_nodes.is_dir():
        raise ValueError(
            f"`comfyui_folder`: {str(root)!r} is not a ComfyUI folder (no custom_nodes folder in it); give the folder "
            "that holds ComfyUI's main.py."
        )
    module = custom_nodes / NODES_FOLDER / "__init__.py"
    if module.exists() and _WRITTEN_BY not in module.read_text(errors="replace"):
        raise ValueError(
            f"`comfyui_folder`: {str(module)!r} exists and was not written by rolldiff; it is left alone."
        )
    module.parent.mkdir(exist_ok=True)
    module.write_text(_MODULE)
    return module
