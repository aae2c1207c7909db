"""The frontend: capture a model and its loss as one torch.fx graph (``capture.py``: ``trace``,
``TracedModel``), canonicalised (``canonicalize.py``), with hand-written attention recognised
(``eager_attention.py``, ``mask_probe.py``)."""

from hgraph.frontend.capture import TracedModel, trace
from hgraph.frontend.loss_module import default_loss

__all__ = ["TracedModel", "default_loss", "trace"]
