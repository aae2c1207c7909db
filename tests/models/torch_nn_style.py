"""Models built from ``torch.nn``'s own parts, the way research code builds them (written here, not
copied): ``nn.TransformerEncoder`` with a causal mask and a head tied by ``F.linear``;
``nn.MultiheadAttention`` blocks (q/k/v packed in one ``in_proj_weight``, unflattened ``(3, E)``) with
a bool mask and a learned position ``nn.Embedding``; einsum attention with q/k/v from one Linear by
``chunk`` and a ``triu`` mask built on the fly. Tiny: vocab 128, dim 64, 4 heads, 2 layers, dropout 0."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, MAX_LEN = 128, 64, 4, 2, 64


class EncoderLM(nn.Module):
    """``nn.TransformerEncoder`` (pre-norm, GELU), learned positions sliced ``[:t]``, tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(MAX_LEN, DIM) * 0.02)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        x = self.encoder(x, mask=mask, is_causal=True)
        return F.linear(self.norm(x), self.tok.weight)


class MHABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MHALM(nn.Module):
    """``nn.MultiheadAttention`` blocks, position ``nn.Embedding`` of ``arange(t)``, a separate head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_LEN, DIM)
        self.blocks = nn.ModuleList(MHABlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class EinsumBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.up, self.down = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, HEADS, DIM // HEADS) for z in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(DIM // HEADS)
        causal = torch.triu(torch.full((t, t), float("-inf"), device=x.device), 1)
        a = torch.einsum("bhqk,bkhd->bqhd", (scores + causal).softmax(-1), v).reshape(b, t, DIM)
        x = x + self.out(a)
        return x + self.down(F.silu(self.up(self.norm2(x))))


class EinsumLM(nn.Module):
    """einsum attention, q/k/v by ``chunk`` of one Linear, a ``triu`` mask, head tied by ``F.linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(EinsumBlock() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.tok.weight)
