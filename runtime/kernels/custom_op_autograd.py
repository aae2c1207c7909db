"""Autograd inside a custom op's kernel: hgraph's packed kernels (attention, the delta rule, causal
convolutions) compute their backward by running autograd over their reference code inside the op."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Let autograd record again inside a custom op's kernel (the dispatcher excludes it there)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    autograd = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded - autograd):
        with torch.enable_grad():
            yield
