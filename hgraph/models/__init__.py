"""Models shipped with hgraph: its own Llama and tiny HuggingFace builders (``llama.py``), and the
HuggingFace model zoo (``zoo.py``: each family in its default config, sizes shrunk)."""

from hgraph.models.llama import Llama, LlamaConfig, init_weights, load_factory, tiny_hf_gpt2, tiny_hf_llama

__all__ = ["Llama", "LlamaConfig", "init_weights", "load_factory", "tiny_hf_gpt2", "tiny_hf_llama"]
