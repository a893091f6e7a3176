"""`pubsub-sidecar emulators` loads the repository's index configuration by default (issue 31), so that
a local sidecar's start-up check sees a database deployed as production's should be."""

from __future__ import annotations

from pathlib import Path

from sidecar.commands.main import build_parser
from sidecar.emulators.main import REPOSITORY_INDEXES, index_file

SHIPPED = Path(__file__).resolve().parents[2] / "firestore.indexes.json"


def _args(*argv: str) -> tuple[str | None, bool]:
    args = build_parser().parse_args(["emulators", *argv])
    return args.firestore_indexes, args.no_firestore_indexes


def test_by_default_the_repositorys_file_is_loaded(tmp_path: Path) -> None:
    assert REPOSITORY_INDEXES == SHIPPED
    requested, disabled = _args()
    assert index_file(requested, disabled=disabled, cwd=tmp_path) == str(SHIPPED)


def test_a_file_in_the_current_directory_comes_first_and_a_named_one_before_it(tmp_path: Path) -> None:
    local = tmp_path / "firestore.indexes.json"
    local.write_text('{"indexes": [], "fieldOverrides": []}')
    requested, disabled = _args()
    assert index_file(requested, disabled=disabled, cwd=tmp_path) == str(local)
    requested, disabled = _args("--firestore-indexes", "/elsewhere/indexes.json")
    assert index_file(requested, disabled=disabled, cwd=tmp_path) == "/elsewhere/indexes.json"


def test_production_defaults_on_request(tmp_path: Path) -> None:
    requested, disabled = _args("--no-firestore-indexes")
    assert disabled and index_file(requested, disabled=disabled, cwd=tmp_path) is None
