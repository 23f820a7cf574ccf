"""ferrolm's Transformer for Hugging Face transformers, loaded with ``trust_remote_code=True``.

This file is written into a model folder by ``ferrolm export --format hf`` for a model that
no architecture of transformers computes (value embeddings, x0 mixing, ReLU^2, soft-capped
logits, post-norm, no positions, ...). It needs only torch and transformers:

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

config.json holds ferrolm's model config under its own field names, and the parameters
carry ferrolm's checkpoint names, so model.safetensors is ferrolm's state dict as saved
(a tied model stores the embedding once). The equations, in the order they run:

    e = E[ids] (/ rms: embed_norm)
    x0 = e (+ lambda sigmoid(e_t[:k] . w) e_{t-1}: smear) (+ T[h(id_{t-1}, id_t)]: bigram_buckets)
         (+ PE[pos] or P[pos]: sinusoidal or learned positions);  x = x0
    per block i:  x = x + s_j skip_j, j = L-1-i, when j < floor(L/2)    (unet_skips; skip_j: block j's output)
                  x = a_i x + b_i x0                                   (x0_mix)
                  pre-norm:  h = x + Attn(N(x));  x = h + FFN(N(h))
                  post-norm: h = N(x + Attn(x));  x = N(h + FFN(h))
    Attn:         q, k, v = x W_Q^T, x W_K^T, x W_V^T (+ E_v[ids] on v in value-embedding layers)
                  RoPE rotates each pair (x[2k], x[2k+1]) by  position * theta^(-2k/d_head)
                  q, k <- q / rms(q), k / rms(k) per head (qk_norm, no weight), or with
                  qk_norm_gain times learned gains g_q, g_k and BEFORE RoPE (Qwen3's order)
                  softmax(q k^T / sqrt(d_head), causal) v; key/value head h // group (GQA);
                  in a short layer (short_window w > 0, window_pattern's 'S', never the last
                  layer) the query at slot p sees only slots j with p - w < j <= p
                  each head's output times sigmoid(x[:k] W_g^T), k = min(12, d_model) (attn_gate)
    FFN:          W2 (SiLU(W1 x) * W3 x) | W2 SiLU(W1 x) | W2 relu(W1 x)^2 | W2 relu(W1 x)
    logits:       N(x) W_head^T (W_head = E when tied), then c tanh(z / c) (logit_softcap)

N is RMSNorm or LayerNorm (computed in float32) or nothing; PE[p, 2i] = sin(p / 10000^(2i/d)),
PE[p, 2i+1] = cos(same). smear's gate reads k = min(12, d_model) features; at a sequence's
first token (and a left-padded row's first real one) neither smear nor the bigram term has a
previous token: no smear, and the reserved bucket B - 1 of the bigram table T (B buckets), whose
hash is h(p, c) = (1000003 p XOR 69069 c) mod (B - 1). In cached generation the token before
the first new position comes from the full ids (``prepare_inputs_for_generation``), or, for a
forward given only a cache, from the ids this model recorded on it. Dropout and label
smoothing act only in ferrolm's training and change nothing here. Keys are cached after RoPE
and QK-norm, values with their value embedding, in transformers' own cache.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

# ferrolm's model config, field by field with its defaults (ferrolm.lm.config.ModelConfig)
FERROLM_FIELDS = {
    "vocab_size": 0,
    "context_length": 256,
    "d_model": 512,
    "num_layers": 4,
    "num_heads": 16,
    "d_ff": 1344,
    "rope_theta": 10000.0,
    "norm": "rms",
    "norm_position": "pre",
    "positions": "rope",
    "ffn": "swiglu",
    "tie_embeddings": False,
    "attention": "fast",
    "d_ff_ungated": 0,
    "norm_eps": 1e-5,
    "num_kv_heads": 0,
    "qk_norm": False,
    "logit_softcap": 0.0,
    "zero_init_output": False,
    "doc_mask": False,
    "value_embeds": False,
    "x0_mix": False,
    "dropout": 0.0,
    "label_smoothing": 0.0,
    "embed_norm": False,
    "qk_norm_gain": False,
    "unet_skips": False,
    "attn_gate": False,
    "short_window": 0,
    "window_pattern": "SSSL",
    "smear": False,
    "bigram_buckets": 0,
    # multi-token prediction: a training loss only, nothing to compute here
    "mtp_weight": 0.0,
    "mtp_depth": 1,
}


SMEAR_WIDTH = 12  # smear's gate reads this many leading features of a position's embedding
BIGRAM_HASH_MULTIPLIERS = (1_000_003, 69_069)  # the bigram hash's two fixed odd constants


class FerroLMConfig(PretrainedConfig):
    """ferrolm's model config (``FERROLM_FIELDS``), with transformers' usual names as aliases."""

    model_type = "ferrolm"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "max_position_embeddings": "context_length",
    }

    def __init__(self, **kwargs):
        for name, default in FERROLM_FIELDS.items():
            setattr(self, name, kwargs.pop(name, default))
        self.use_cache = kwargs.pop("use_cache", True)
        kwargs["tie_word_embeddings"] = False  # the head reads the embedding itself when tied
        super().__init__(**kwargs)

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.d_head

    @property
    def ffn_hidden(self) -> int:
        if self.ffn == "swiglu":
            return self.d_ff
        return self.d_ff_ungated or round(3 * self.d_ff / 2)

    def has_value_embed(self, layer: int) -> bool:
        """The last layer and every second one before it."""
        return self.value_embeds and (self.num_layers - 1 - layer) % 2 == 0

    def is_short(self, layer: int) -> bool:
        """A short-window layer: window_pattern (cycled) says 'S' and it is not the last layer."""
        pattern = self.window_pattern
        return self.short_window > 0 and layer < self.num_layers - 1 and pattern[layer % len(pattern)] == "S"


def rms_normalize(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) (times weight), in float32, cast back."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


def sinusoidal_table(num_positions: int, d_model: int) -> torch.Tensor:
    """PE[p, 2i] = sin(p / 10000^(2i / d_model)), PE[p, 2i + 1] = cos of the same angle."""
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] / torch.pow(
        10000.0, torch.arange(0, d_model, 2, dtype=torch.float64) / d_model
    )
    table = torch.zeros(num_positions, d_model, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = angles.sin(), angles.cos()[:, : d_model // 2]
    return table.float()


def rotate_pairs(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on x (batch, heads, seq, d_head) at positions (batch, seq): each pair
    (x[2k], x[2k+1]) turned by the angle position * theta^(-2k/d_head), in float32."""
    d_head = x.shape[-1]
    k = torch.arange(d_head // 2, device=x.device, dtype=torch.float64)
    angles = positions.double()[:, None, :, None] * theta ** (-2.0 * k / d_head)
    cos, sin = angles.cos().float(), angles.sin().float()
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


class Gate(nn.Module):
    """attn_gate: sigmoid(x[..., :k] W_g^T), W_g (num_heads, k), one gate per head and position."""

    def __init__(self, num_heads: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, d) -> (batch, heads, seq, 1)
        return torch.sigmoid(F.linear(x[..., : self.weight.shape[1]], self.weight)).transpose(1, 2)[..., None]


class Attention(nn.Module):
    def __init__(self, config: FerroLMConfig, layer: int):
        super().__init__()
        self.config, self.layer = config, layer
        kv_dim = config.num_key_value_heads * config.d_head
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.output_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        if config.qk_norm and config.qk_norm_gain:
            self.q_norm = RMSNorm(config.d_head, config.norm_eps)
            self.k_norm = RMSNorm(config.d_head, config.norm_eps)
        if config.attn_gate:
            self.gate = Gate(config.num_heads, min(12, config.d_model))

    def forward(self, x, positions, mask, cache, value_embed):
        cfg = self.config
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (batch, seq, n d_head) -> (batch, n, seq, d_head)
            return t.view(batch, seq, -1, cfg.d_head).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        if value_embed is not None:
            v = v + heads(value_embed)
        gains = cfg.qk_norm and cfg.qk_norm_gain
        if gains:  # the gains do not commute with the rotation: normed first, as Qwen3 does
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.positions == "rope":
            q, k = rotate_pairs(q, positions, cfg.rope_theta), rotate_pairs(k, positions, cfg.rope_theta)
        if cfg.qk_norm and not gains:
            q, k = rms_normalize(q, None, cfg.norm_eps), rms_normalize(k, None, cfg.norm_eps)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        group = cfg.num_heads // cfg.num_key_value_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if cfg.attn_gate:
            out = out * self.gate(x).to(out.dtype)
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, cfg.d_model))


class FFN(nn.Module):
    def __init__(self, config: FerroLMConfig):
        super().__init__()
        self.kind = config.ffn
        self.w1 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.d_model, bias=False)
        if self.kind == "swiglu":
            self.w3 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        if self.kind == "swiglu":
            h = F.silu(h) * self.w3(x)
        elif self.kind == "relu2":
            h = torch.relu(h).square()
        elif self.kind == "relu":
            h = torch.relu(h)
        else:
            h = F.silu(h)
        return self.w2(h)


def make_norm(config: FerroLMConfig) -> nn.Module:
    if config.norm == "layer":
        return LayerNorm(config.d_model, config.norm_eps)
    return RMSNorm(config.d_model, config.norm_eps) if config.norm == "rms" else nn.Identity()


class Block(nn.Module):
    def __init__(self, config: FerroLMConfig, layer: int):
        super().__init__()
        self.pre = config.norm_position == "pre"
        self.ln1, self.ln2 = make_norm(config), make_norm(config)
        self.attn = Attention(config, layer)
        self.ffn = FFN(config)

    def forward(self, x, positions, mask, cache, value_embed):
        if self.pre:
            h = x + self.attn(self.ln1(x), positions, mask, cache, value_embed)
            return h + self.ffn(self.ln2(h))
        h = self.ln1(x + self.attn(x, positions, mask, cache, value_embed))
        return self.ln2(h + self.ffn(h))


def attention_mask_4d(attention_mask, batch: int, seq: int, past: int, device) -> torch.Tensor:
    """Bool (batch, 1, seq, past + seq), True = may attend: causal over the cache's slots,
    minus the padding that ``attention_mask`` (batch, past + seq) marks with 0. A query
    always sees its own slot, so a padding row is never empty. A 4-D mask, what transformers
    builds for a static cache, is taken as it is (an additive one: 0 = may attend)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    slots = torch.arange(past + seq, device=device)
    own = past + torch.arange(seq, device=device)
    mask = (slots[None, :] <= own[:, None]).expand(batch, 1, seq, past + seq)
    if attention_mask is not None:
        keep = attention_mask[:, None, None, -(past + seq) :].bool()
        mask = (mask & keep) | (slots[None, :] == own[:, None])
    return mask


class FerroLMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = FerroLMConfig
    base_model_prefix = "ferrolm"
    _no_split_modules = ["Block"]

    def __init__(self, config: FerroLMConfig):
        super().__init__(config)
        self.token_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.ln_final = make_norm(config)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        kv_dim = config.num_key_value_heads * config.d_head
        layers = [i for i in range(config.num_layers) if config.has_value_embed(i)]
        self.value_embeddings = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, kv_dim) for i in layers})
        if config.x0_mix:
            self.residual_scales = nn.Parameter(torch.ones(config.num_layers))
            self.x0_scales = nn.Parameter(torch.zeros(config.num_layers))
        if config.positions == "learned":
            self.position_embeddings = nn.Embedding(config.context_length, config.d_model)
        if config.unet_skips:
            self.skip_scales = nn.Parameter(torch.ones(config.num_layers // 2))
        if config.smear:
            self.smear_gate = nn.Parameter(torch.zeros(min(SMEAR_WIDTH, config.d_model)))
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if config.bigram_buckets:
            self.bigram_embeddings = nn.Embedding(config.bigram_buckets, config.d_model)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """ferrolm's initialization: truncated normal, std sqrt(2 / (in + out)) for a matrix and
        1 for an embedding, cut at 3 std; norm gains 1; the x0 mix starts as the plain residual;
        U-net skips at 1, attention gates, smearing and the bigram table at 0."""
        if isinstance(module, nn.Linear):
            std = math.sqrt(2.0 / sum(module.weight.shape))
            nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
        elif isinstance(module, nn.Embedding):
            if module is getattr(self, "bigram_embeddings", None):
                nn.init.zeros_(module.weight)
            else:
                nn.init.trunc_normal_(module.weight, std=1.0, a=-3.0, b=3.0)
        elif isinstance(module, (RMSNorm, LayerNorm)):
            nn.init.ones_(module.weight)
            if isinstance(module, LayerNorm):
                nn.init.zeros_(module.bias)
        elif isinstance(module, Gate):
            nn.init.zeros_(module.weight)
        elif module is self:
            if self.config.x0_mix:
                nn.init.ones_(self.residual_scales)
                nn.init.zeros_(self.x0_scales)
            if self.config.unet_skips:
                nn.init.ones_(self.skip_scales)
            if self.config.smear:
                nn.init.zeros_(self.smear_gate)
                nn.init.zeros_(self.smear_lambda)

    def get_input_embeddings(self) -> nn.Module:
        return self.token_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.token_embeddings = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        previous_ids=None,
        **kwargs,
    ):
        """Logits (batch, seq, vocab) of ``input_ids``; with ``labels``, the next-token loss
        (-100 ignored). The cache is ``cache`` (transformers 5) or ``past_key_values`` (4).
        ``previous_ids`` (batch, 1): the token before ``input_ids`` when a cache holds the
        positions before them (smear, bigram_buckets); by default the one recorded on the cache."""
        if input_ids is None:
            raise ValueError("ferrolm's model needs input_ids (value embeddings read the token ids)")
        cache = cache if cache is not None else past_key_values
        if cache is None and (self.config.use_cache if use_cache is None else use_cache):
            cache = DynamicCache()
        batch, seq = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=input_ids.device)[None].expand(batch, seq)
        mask = attention_mask_4d(attention_mask, batch, seq, past, input_ids.device)
        prev = None
        if self.config.smear or self.config.bigram_buckets:
            prev = self.previous_token_ids(input_ids, past, mask, cache, previous_ids)
        x = self.hidden_states(input_ids, position_ids, (mask, self.short_mask(mask, seq, past)), cache, prev)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        head = self.token_embeddings.weight if self.config.tie_embeddings else self.lm_head.weight
        logits = F.linear(self.ln_final(x), head)
        if self.config.logit_softcap:
            logits = self.config.logit_softcap * torch.tanh(logits / self.config.logit_softcap)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def short_mask(self, mask: torch.Tensor, seq: int, past: int) -> torch.Tensor:
        """``mask`` for the short-window layers: the query at slot past + i sees slots j with
        past + i - short_window < j only (and what ``mask`` lets it see)."""
        if not self.config.short_window:
            return mask
        slots = torch.arange(mask.shape[-1], device=mask.device)
        own = past + torch.arange(seq, device=mask.device)
        return mask & (slots[None, :] > own[:, None] - self.config.short_window)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        """transformers' inputs for the next step, plus the token before the first new one
        (taken from the full ids, so beam search's reordering carries it)."""
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        new = inputs.get("input_ids")
        if (self.config.smear or self.config.bigram_buckets) and new is not None:
            start = input_ids.shape[1] - new.shape[1]
            if start > 0:
                inputs["previous_ids"] = input_ids[:, start - 1 : start]
        return inputs

    def previous_token_ids(self, ids, past: int, mask, cache, previous) -> torch.Tensor:
        """The id before each of ``ids``' positions, -1 where there is none: position 0, and
        after a padded slot (the mask hides the previous slot from the query). Records the ids
        on the cache for a later forward given no ``previous``."""
        batch, seq = ids.shape
        seen = getattr(cache, "ferrolm_ids", None) if cache is not None else None
        if past > 0 and previous is None:
            if seen is None or seen.shape[1] < past:
                raise ValueError(
                    "smear and bigram_buckets read the token before the first new one: pass previous_ids "
                    "(batch, 1) with a cache this model did not fill"
                )
            previous = seen[:, past - 1 : past]
        first = previous.to(ids) if past > 0 else ids.new_full((batch, 1), -1)
        prev = torch.cat((first, ids[:, :-1]), dim=1)
        slots = past - 1 + torch.arange(seq, device=ids.device)
        visible = mask[:, 0, torch.arange(seq, device=ids.device), slots.clamp(min=0)].expand(batch, seq)
        prev = torch.where(visible & (slots >= 0), prev, -1)
        if cache is not None:
            kept = seen[:, :past] if seen is not None and seen.shape[1] >= past else ids.new_zeros((batch, past))
            cache.ferrolm_ids = torch.cat((kept.to(ids), ids), dim=1)
        return prev

    def embed(self, ids) -> torch.Tensor:
        x = self.token_embeddings(ids)
        return rms_normalize(x, None, self.config.norm_eps) if self.config.embed_norm else x

    def previous_token_terms(self, x, ids, prev) -> torch.Tensor:
        """x plus smear's term and the bigram table's row (see the module docstring)."""
        out = x
        if self.config.smear:
            before = self.embed(prev[:, :1].clamp(min=0))
            x_prev = torch.cat((before, x[:, :-1]), dim=1) * (prev >= 0).unsqueeze(-1).to(x.dtype)
            gate = torch.sigmoid((x[..., : self.smear_gate.shape[0]] * self.smear_gate).sum(-1, keepdim=True))
            out = out + self.smear_lambda * gate * x_prev
        if self.config.bigram_buckets:
            buckets = self.config.bigram_buckets
            a, b = BIGRAM_HASH_MULTIPLIERS
            h = torch.bitwise_xor(prev.long() * a, ids.long() * b) % (buckets - 1)
            out = out + self.bigram_embeddings(torch.where(prev >= 0, h, buckets - 1))
        return out

    def hidden_states(self, ids, positions, masks, cache, prev=None) -> torch.Tensor:
        """Embedding and blocks: the last block's output; ``masks`` is (long layers', short
        layers'); ``prev`` the id before each position (smear, bigram_buckets)."""
        x = self.embed(ids)
        if prev is not None:
            x = self.previous_token_terms(x, ids, prev)
        if self.config.positions == "learned":
            x = x + self.position_embeddings(positions.clamp(min=0))
        elif self.config.positions == "sinusoidal":
            # made here, not kept as a buffer: a buffer missing from the weights file is left
            # unset when transformers builds the model on the meta device
            table = sinusoidal_table(self.config.context_length, self.config.d_model).to(x.device, x.dtype)
            x = x + table[positions.clamp(min=0)]
        x0 = x
        num_layers = self.config.num_layers
        num_skips = num_layers // 2 if self.config.unet_skips else 0
        skips = []
        for i, block in enumerate(self.layers):
            if i >= num_layers - num_skips:  # the skip first, then the x0 mix
                x = x + self.skip_scales[num_layers - 1 - i] * skips[num_layers - 1 - i]
            if self.config.x0_mix:
                x = self.residual_scales[i] * x + self.x0_scales[i] * x0
            table = self.value_embeddings[str(i)] if str(i) in self.value_embeddings else None
            mask = masks[1] if self.config.is_short(i) else masks[0]
            x = block(x, positions, mask, cache, None if table is None else table(ids))
            if i < num_skips:
                skips.append(x)
        return x


# transformers 5 names the output's cache "cache", transformers 4 "past_key_values"
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
