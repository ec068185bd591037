"""A lean GPT-2 in one file, of the design nanoGPT's model.py published (Karpathy, 2022): pre-norm blocks of causal
self-attention through PyTorch's scaled_dot_product_attention and a GELU MLP four times as wide, learned positions,
the output layer tied to the token embedding, normal(0, 0.02) weights with the residual projections scaled down by
the depth. It is the PyTorch peer a researcher writes by hand, beside transformers' GPT2LMHeadModel, in
benchmarks/gpu_suite.py; written for this project from that description.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LeanGPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded to a multiple of 64
    sequence_length: int = 1024
    layers: int = 12
    heads: int = 12
    width: int = 768


class CausalSelfAttention(nn.Module):
    def __init__(self, config: LeanGPTConfig):
        super().__init__()
        self.heads = config.heads
        self.query_key_value = nn.Linear(config.width, 3 * config.width)
        self.output = nn.Linear(config.width, config.width)

    def forward(self, hidden):
        batch, length, width = hidden.shape
        # (batch, length, 3 x width) -> three of (batch, heads, length, head width)
        queries, keys, values = (
            part.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for part in self.query_key_value(hidden).split(width, dim=2)
        )
        attended = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        return self.output(attended.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, config: LeanGPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width), nn.GELU(), nn.Linear(4 * config.width, config.width)
        )

    def forward(self, hidden):
        hidden = hidden + self.attention(self.attention_norm(hidden))
        return hidden + self.mlp(self.mlp_norm(hidden))


class LeanGPT(nn.Module):
    def __init__(self, config: LeanGPTConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.width)
        self.position_embedding = nn.Embedding(config.sequence_length, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(config.width)
        self.output = nn.Linear(config.width, config.vocab_size, bias=False)
        self.output.weight = self.token_embedding.weight  # tied: one matrix reads tokens in and scores them out
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif parameter.dim() >= 2:
                # Each block adds two residual branches: scaled so the residual stream's variance stays put.
                residual = name.endswith(("attention.output.weight", "mlp.2.weight"))
                std = 0.02 / math.sqrt(2 * config.layers) if residual else 0.02
                nn.init.normal_(parameter, mean=0.0, std=std)

    def forward(self, input_ids, labels=None):
        """Logits (batch, length, vocabulary), and with `labels` (the input ids) the mean next-token loss."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.token_embedding(input_ids) + self.position_embedding(positions)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.output(self.final_norm(hidden))
        if labels is None:
            return logits, None
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return logits, loss
