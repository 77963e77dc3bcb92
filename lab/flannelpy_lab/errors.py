"""The lab's one error type: a sentence saying what failed and what to do next."""

from __future__ import annotations

from flannelpy.errors import FlannelpyError


class LabError(FlannelpyError):
    """Building, inspecting or tearing down a netns lab failed."""

    exit_code = 1
