"""The layout's rules, held: which layer may import which, who imports each Google library, no
import cycle, no oversized module.

The top folder of ``sidecar/`` is the architecture (docs/architecture.md): each package's docstring
says what the layer does and what it may import, and ``_MAY_IMPORT`` below is that rule as data. A
new dependency between layers is a design decision: make it here, in the package docstring and in
docs/architecture.md together, or move the code to the layer it belongs to.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIDECAR = ROOT / "sidecar"

_LEAVES = {"backoff", "shards"}
"""Top-level modules every layer may use: a jittered backoff, and which shard a key belongs to."""

_MAY_IMPORT: dict[str, set[str]] = {
    "engine": set(),
    "ops": set(),
    "emulators": set(),
    "config": {"engine"},
    "store": {"engine", "config"},
    "cluster": {"store", "engine", "config"},
    "dead_letters": {"engine", "config"},
    "pipeline": {"engine", "store", "dead_letters", "config", "ops"},
    "delivery": {"pipeline", "store", "engine", "config", "ops"},
    "peering": {"pipeline", "engine", "config", "ops"},
    "publishing": {"store", "cluster", "config", "ops"},
    "wiring": {
        *("pipeline", "delivery", "cluster", "peering", "store", "engine", "dead_letters", "config", "ops"),
        "publishing",
    },
    "commands": {"wiring", "delivery", "dead_letters", "config", "ops", "emulators", "engine", "publishing"},
}
"""Layer -> the layers it may import (besides itself and the leaves). Lowest first: the engine and
ops import nothing of the sidecar; commands sit on top. ``sidecar.__main__`` imports ``commands``."""

_GOOGLE_LIBRARIES: dict[str, tuple[tuple[str, ...], set[str]]] = {
    "google-cloud-firestore": (
        ("google.cloud.firestore", "google.cloud.firestore_v1", "google.cloud.firestore_admin_v1"),
        {"sidecar.store.firestore"},
    ),
    "google-cloud-monitoring": (("google.cloud.monitoring_v3",), {"sidecar.pipeline.watermark_source"}),
    "google-cloud-pubsub": (
        ("google.cloud.pubsub_v1", "google.pubsub_v1", "google.cloud.pubsub"),
        {
            # One module per job: the subscriber (ingest's streaming pull, with the scheduler and the
            # transport it alone uses), the dead-letter publisher, the dead-letter tooling, the demo's
            # publisher.
            "sidecar.pipeline.ingest_pull",
            "sidecar.pipeline.ingest_scheduler",
            "sidecar.pipeline.ingest_watch",
            "sidecar.pipeline.ingest_pubsub_rpc",  # the stream intake's calls: raw message classes, the channel
            "sidecar.dead_letters.publisher",
            "sidecar.dead_letters.subscription",
            "sidecar.commands.demo_pubsub",
            "sidecar.publishing.publisher",  # the outbox relay's
        },
    ),
    # Not Google's, held the same way: the OpenTelemetry SDK and its exporters in one module (spans
    # are made through the API, opentelemetry.trace, by pipeline.message_traces).
    "opentelemetry-sdk": (("opentelemetry.sdk", "opentelemetry.exporter"), {"sidecar.ops.tracing"}),
}
"""Library -> (its import prefixes, the only modules of ours that may import it). The emulators
implement these services and are not counted."""

_MAX_LINES = 520
"""About 500: a module past it holds more than one job (split it by job, not by size)."""

_LONG_MODULES: dict[str, str] = {
    "sidecar/store/firestore.py": (
        "the store's only google-cloud-firestore importer: the client, the RPCs, the fenced transaction, the "
        "Listen stream and the admin check all need its types; the Google-free parts are firestore_codec.py, "
        "firestore_errors.py and listen_protocol.py"
    ),
}
"""Module -> why it may stay longer than ``_MAX_LINES``. Generated code and the emulators are not counted."""


@dataclass(frozen=True, slots=True)
class _Import:
    module: str
    """The importing module, dotted."""
    target: str
    """The imported module, dotted (for ``from a import b``: ``a.b`` when that is a module, else ``a``).
    Imports inside functions and under ``TYPE_CHECKING`` count like the others."""


def _modules(root: Path, package_root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(package_root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> Iterator[_Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def resolve(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, node.module] if node.module else base)

    def visit(nodes: list[ast.stmt]) -> Iterator[_Import]:
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield _Import(module, alias.name)
            elif isinstance(node, ast.ImportFrom):
                source = resolve(node)
                for alias in node.names:
                    candidate = f"{source}.{alias.name}"
                    external = not any(source == k or source.startswith(k + ".") for k in known)
                    target = candidate if candidate in known or external else source
                    yield _Import(module, target)
            else:
                yield from visit([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)])
                for handler in getattr(node, "handlers", []):
                    yield from visit(handler.body)

    yield from visit(tree.body)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "sidecar" or len(parts) == 1:
        return None
    return parts[1]


_SIDECAR_MODULES = _modules(SIDECAR, ROOT)


def test_every_layer_imports_only_the_layers_below_it() -> None:
    known = set(_SIDECAR_MODULES)
    broken = []
    for module, path in _SIDECAR_MODULES.items():
        source = _layer(module)
        if source is None or source in _LEAVES or source == "__main__":
            continue
        assert source in _MAY_IMPORT, f"{module}: layer {source!r} has no import rule in _MAY_IMPORT"
        for imp in _imports(module, path, known):
            target = _layer(imp.target)
            if target is None or target == source or target in _LEAVES:
                continue
            if target not in _MAY_IMPORT[source]:
                broken.append(f"{module} imports {imp.target} ({source} may not import {target})")
    assert broken == []


def test_the_leaves_import_nothing_of_the_sidecar() -> None:
    known = set(_SIDECAR_MODULES)
    for leaf in _LEAVES:
        module = f"sidecar.{leaf}"
        imports = [
            i.target for i in _imports(module, _SIDECAR_MODULES[module], known) if i.target.startswith("sidecar")
        ]
        assert imports == [], f"{module} is a leaf every layer uses: it imports {imports}"


def test_every_layer_says_what_it_does_and_what_it_may_import() -> None:
    for layer in _MAY_IMPORT:
        doc = ast.get_docstring(ast.parse((SIDECAR / layer / "__init__.py").read_text()))
        assert doc, f"sidecar/{layer}/__init__.py has no docstring"
        if layer not in {"engine", "store", "emulators"}:
            assert "import" in doc, f"sidecar/{layer}/__init__.py does not say what the layer may import"
    layers = {p.name for p in SIDECAR.iterdir() if (p / "__init__.py").is_file()}
    assert layers == set(_MAY_IMPORT), "a layer without an import rule, or a rule for a missing layer"


@pytest.mark.parametrize("library", sorted(_GOOGLE_LIBRARIES))
def test_each_google_library_is_imported_by_its_own_modules_only(library: str) -> None:
    prefixes, allowed = _GOOGLE_LIBRARIES[library]
    known = set(_SIDECAR_MODULES)
    importers = {
        module
        for module, path in _SIDECAR_MODULES.items()
        if _layer(module) != "emulators"
        for imp in _imports(module, path, known)
        if any(imp.target == p or imp.target.startswith(p + ".") for p in prefixes)
    }
    assert importers == allowed


def _cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Dependency cycles among ``modules``: Tarjan's strongly connected components of more than one
    module. Every import counts, inside functions and under TYPE_CHECKING too: a cycle hidden from
    the interpreter is still two modules that cannot be understood one before the other."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for imp in _imports(module, path, known):
            # The module itself (or the nearest module above a name it imports): a package's
            # ``__init__`` that runs first is partly initialised, as Python allows, not a cycle.
            parts = imp.target.split(".")
            targets |= next(
                ({".".join(parts[:n])} for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in known), set()
            )
        graph[module] = targets - {module}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _package_and_submodule_cycle(component: list[str]) -> bool:
    """A package whose ``__init__`` re-exports its own submodules forms a harmless cycle with them."""
    return len(component) == 2 and component[1].startswith(component[0] + ".")


@pytest.mark.parametrize(
    ("tree", "package_root"),
    [
        ("sidecar", "."),
        ("bench", "."),
        ("clients/python/src/pubsub_sidecar_client", "clients/python/src"),
    ],
)
def test_no_import_cycle(tree: str, package_root: str) -> None:
    modules = _modules(ROOT / tree, ROOT / package_root)
    assert len(modules) > 3
    cycles = [c for c in _cycles(modules) if not _package_and_submodule_cycle(c)]
    assert cycles == []


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    """The check above can fail: a two-module cycle and a three-module one are both found."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("import pkg.a\n")
    (package / "c.py").write_text("from pkg.d import x\n")
    (package / "d.py").write_text("from pkg import e\nx = 1\n")
    (package / "e.py").write_text("x = 1\n")
    assert _cycles(_modules(package, tmp_path)) == [["pkg.a", "pkg.b"]]
    (package / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n")
    assert sorted(_cycles(_modules(package, tmp_path))) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.e"]]


def test_no_module_past_about_500_lines() -> None:
    trees = [
        SIDECAR,
        ROOT / "bench",
        ROOT / "clients/python/src/pubsub_sidecar_client",
        ROOT / "tests",
        ROOT / "scripts",
    ]
    long = {}
    for tree in trees:
        for path in tree.rglob("*.py"):
            relative = str(path.relative_to(ROOT))
            if relative.startswith("sidecar/emulators/") or path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")):
                continue
            lines = len(path.read_text().splitlines())
            if lines > _MAX_LINES and relative not in _LONG_MODULES:
                long[relative] = lines
    assert long == {}, "split these by job, or list them in _LONG_MODULES with the reason"
