"""Kubernetes Services over the overlay with kube-proxy in nftables mode: the tests of
``test_kube_services.py`` on a kubelet lab of its own (``--proxy-mode nftables``)."""

from __future__ import annotations

import pytest

from tests.e2e.test_kube_services import (  # noqa: F401 (collected here, on this module's lab)
    lab,
    test_services_with_ip_masq,
    test_services_without_ip_masq,
    test_status_tells_the_truth_on_the_kubelet_lab,
)

pytestmark = [pytest.mark.lab]

PROXY_MODE = "nftables"
