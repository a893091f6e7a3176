"""The Firestore emulator fixtures of the store tests (``tests/store/conftest.py``), reused here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("store_conftest", Path(__file__).parent.parent / "store" / "conftest.py")
assert _spec is not None and _spec.loader is not None
_store_conftest = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _store_conftest  # dataclasses look their module up there
_spec.loader.exec_module(_store_conftest)

firestore_emulator = _store_conftest.firestore_emulator
emulator = _store_conftest.emulator
