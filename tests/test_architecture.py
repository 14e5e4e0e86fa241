"""The package layout as a specification: imports run one way (no cycle, type-only and function-level imports
included), no file name exists in both `models/` and `pipelines/`, and every public name of the README and
DESIGN still imports from where users import it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["rolldiff", *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in SRC.rglob("*.py")}


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """Every rolldiff module `module` imports anywhere in its file (top level, functions, TYPE_CHECKING)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from package import submodule` imports the submodule; `from module import name` the module
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known and name != module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {module: _imported(module, path, known) for module, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in graph[node]:
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_package_has_no_import_cycle():
    assert import_cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_file_name_is_in_both_models_and_pipelines():
    models = {path.name for path in (SRC / "models").rglob("*.py")} - {"__init__.py"}
    pipelines = {path.name for path in (SRC / "pipelines").rglob("*.py")} - {"__init__.py"}
    assert models & pipelines == set()


@pytest.mark.parametrize(
    "module, names",
    [
        ("rolldiff", ["KreaRealtimeVideoPipeline", "LongSanaVideoPipeline", "GlmImageCachedPipeline", "ChunkStream",
                      "KreaRealtimeTransformer3DModel", "LongSanaTransformer3DModel", "RollingKVCache", "ChunkLayout",
                      "SlidingWindowLayer", "TinyVideoAutoencoder"]),
        ("rolldiff.pipelines", ["ChunkedVideoPipeline", "ChunkStream", "VideoRequest", "CacheOptions", "PromptSchedule",
                                "StreamingVideoWriter", "StreamingWanDecoder", "denormalize_wan_latents",
                                "KreaRealtimeVideoPipelineOutput", "LongSanaVideoPipelineOutput", "build_request",
                                "ResumeError", "write_video", "StreamPipeline"]),
        ("rolldiff.pipelines.request", ["VideoRequest", "CacheOptions", "VideoGeometry", "build_request"]),
        ("rolldiff.pipelines.stream", ["ChunkStream", "StreamPipeline"]),
        ("rolldiff.models", ["KreaRealtimeTransformer3DModel", "LongSanaTransformer3DModel", "ChunkLayout",
                             "GlmImageCachedTransformer2DModel", "convert_original_wan_state_dict"]),
        ("rolldiff.models.family", ["VideoTransformer", "PIPELINE_HOOKS"]),
        ("rolldiff.recipes", ["list_recipes", "describe_recipe", "get_recipe"]),
        ("rolldiff.story", ["parse_story", "Story", "Scene"]),
        ("rolldiff.pipelines.io", ["write_video", "subtitle_overlay", "draw_subtitle"]),
        ("rolldiff.defaults", ["load_pipeline", "default_model_path", "embedded_models"]),
    ],
)  # fmt: skip
def test_public_names_still_import(module, names):
    loaded = importlib.import_module(module)
    missing = [name for name in names if not hasattr(loaded, name)]
    assert missing == []


def test_every_package_is_in_the_wheel():
    """`pip install .` ships only the packages pyproject lists; the editable install CI uses finds every folder, so a
    package left out of the list would pass CI and be missing for users (`rolldiff` failing at its first import)."""
    import tomllib

    setuptools = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {_module_name(init) for init in SRC.rglob("__init__.py")}
    # data-only folders (the embedded models, the server's page) are listed too, with their files in package-data:
    # a data folder that is not listed is shipped anyway, with a warning from setuptools at every install
    data = set(setuptools["package-data"])
    assert all((SRC / Path(*name.split(".")[1:])).is_dir() for name in data), sorted(data)
    code = listed - data
    assert code == folders, f"not listed: {sorted(folders - code)}; listed but absent: {sorted(code - folders)}"
    assert data <= listed, f"data folders not in packages: {sorted(data - listed)}"
