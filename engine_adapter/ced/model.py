"""The CED model: embedding, pre-norm blocks (CSA2 attention + SwiGLU), final norm, LM head.

No state lives here: every forward reads and writes the `SequenceState` in its `StepContext`,
and computes only the rows its `RowPlan` asks for (see plan.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .config import CEDConfig
from .context import StepContext
from .layers import Linear, RMSNorm, RotaryTail, SwiGLU


class Block(nn.Module):
    """h + attn(norm(h)), then + ffn(norm(.)), for the trailing rows the next layer reads."""

    def __init__(self, config: CEDConfig, layer_id: int, rope: RotaryTail, index_rope: RotaryTail, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.attn = Attention(config, layer_id, rope, index_rope, **kw)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.ffn = SwiGLU(config.d_model, config.d_ffn, **kw)

    def forward(self, h: torch.Tensor, num_out: int, ctx: StepContext) -> torch.Tensor:
        h_out = h[-num_out:] + self.attn(self.attn_norm(h), num_out, ctx)
        return h_out + self.ffn(self.ffn_norm(h_out))


class CEDModel(nn.Module):
    """The whole stack. Build it with `build_model` to get seeded weights."""

    def __init__(self, config: CEDConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.config = config
        rope_device = torch.device("cpu") if device.type == "meta" else device
        rope = RotaryTail(config.d_rope, config.rope_theta, rope_device)
        index_rope = RotaryTail(config.index_rope, config.rope_theta, rope_device)
        self.embed = nn.Embedding(config.vocab_size, config.d_model, **kw)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(config, i, rope, index_rope, **kw) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.head = Linear(config.d_model, config.vocab_size, **kw)

    def forward(self, token_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """token_ids: the trailing `plan.token_rows` tokens -> [plan.logit_rows, vocab] logits."""
        plan = ctx.plan
        h = self.embed(token_ids)
        for layer_id, block in enumerate(self.blocks):
            h = block(h[-plan.layer_rows[layer_id]:], plan.output_rows(layer_id), ctx)
        return self.head(self.norm(h[-plan.logit_rows:]))


def init_weights(model: CEDModel, seed: int) -> None:
    """Deterministic random weights: norms 1, matrices N(0, 1/fan_in), embedding and sinks N(0, 1).

    Values are drawn in float32 in registration order from one generator on the model's device,
    then cast, so a float32 and a float64 engine of the same seed share their weights (on the
    CPU; a CUDA generator draws a different, equally deterministic, stream).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name.endswith("wo_a"):
                std = p.shape[1] ** -0.5
            elif name.endswith("sink") or name.startswith("embed"):
                std = 1.0
            else:
                std = p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(std))


def build_model(config: CEDConfig, seed: int, device: torch.device, dtype: torch.dtype) -> CEDModel:
    """A model with seeded weights; on `device="meta"` only shapes exist (no memory, no init)."""
    model = CEDModel(config, dtype=dtype, device=device)
    if device.type != "meta":
        init_weights(model, seed)
    return model.eval()
