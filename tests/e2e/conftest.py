"""Fixtures of the end-to-end tier: labs shared by a test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flannelpy_lab import Lab

from tests.support.kube_standin import KubeStandin
from tests.support.lab_util import running_kube_lab


@pytest.fixture(scope="module")
def kube_lab() -> Iterator[tuple[Lab, KubeStandin]]:
    """A three-node lab in Kubernetes mode, one per test module (see ``running_kube_lab``)."""
    with running_kube_lab() as (lab, api):
        yield lab, api
