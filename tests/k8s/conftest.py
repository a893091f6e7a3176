"""Fixtures of the manifest tests: each runs against the base and against the example overlay."""

from __future__ import annotations

import pytest
from kustomize_build import Resource
from rendered_manifests import BASE, OVERLAY, rendered_copy


@pytest.fixture(params=["base", "overlay"])
def rendered(request: pytest.FixtureRequest) -> list[Resource]:
    return rendered_copy(BASE if request.param == "base" else OVERLAY)
