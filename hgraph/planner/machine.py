"""What identifies this machine in a profile's cache key (host, CPUs, architecture, torch version)."""

from __future__ import annotations

import os
import platform
from typing import Any


def machine() -> dict[str, Any]:
    """What identifies this machine in a profile's cache key."""
    import torch

    return {"host": platform.node(), "cpus": os.cpu_count(), "arch": platform.machine(), "torch": torch.__version__}
