"""The engine is pure: no module under sidecar/engine imports I/O, clocks or asyncio (issue 4)."""

from __future__ import annotations

import ast
from pathlib import Path

import sidecar.engine

_FORBIDDEN = {"grpc", "google", "asyncio", "time"}


def test_engine_modules_import_no_grpc_google_asyncio_or_time() -> None:
    package = Path(sidecar.engine.__file__).parent
    sources = sorted(package.glob("*.py"))
    assert len(sources) >= 5
    offenders = []
    for source in sources:
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{source.name}: {name}" for name in names if name.split(".")[0] in _FORBIDDEN]
    assert offenders == []
