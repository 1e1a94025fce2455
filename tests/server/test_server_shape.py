"""The server's shape (issue 19 item 5): it reaches the engine only through what
``engine_like.EngineLike`` names (no ``getattr``/``hasattr`` probes, no ``type: ignore``),
and its routes live on module-level routers, not in closures of ``build_app``."""

from __future__ import annotations

import ast
from pathlib import Path

from kvserve.server import routes
from kvserve.server.app import build_app
from tests.server.fake_engine import FakeEngine

SERVER = Path(__file__).resolve().parents[2] / "kvserve" / "server"


def test_no_duck_probes_or_type_ignores_in_the_server() -> None:
    found = []
    for path in sorted(SERVER.glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                found.append(f"{path.name}:{node.lineno} {node.func.id}")
        for lineno, line in enumerate(text.splitlines(), 1):
            if "type: ignore" in line:
                found.append(f"{path.name}:{lineno} type: ignore")
    assert not found, found


def test_every_route_comes_from_a_module_level_router() -> None:
    app_tree = ast.parse((SERVER / "app.py").read_text())
    (build,) = [n for n in app_tree.body if getattr(n, "name", None) == "build_app"]
    nested = [
        f"app.py:{node.lineno} {node.name}"
        for node in ast.walk(build)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not build
    ]
    assert not nested, nested  # no route (or other) closures in build_app
    served = set(build_app(FakeEngine(), debug_endpoints=True).openapi()["paths"])
    from_routers = {
        r.path.replace(":path}", "}")  # the schema drops the path converter
        for router in (routes.ops_router, routes.api_router, routes.debug_router)
        for r in router.routes
    }
    assert served == from_routers
