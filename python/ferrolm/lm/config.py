"""Training configuration: five dataclass sections read from TOML, overridable by ``--set``.

    [model]      ModelConfig: the Transformer's shape and switches (TransformerLM's config)
    [data]       train / validation shards, optionally the tokenizer to check them against
    [optimizer]  AdamW, or Muon with AdamW groups; gradient clipping
    [schedule]   steps, batch, tokens per step, warmup + cosine or warmup-stable-decay, time budget
    [run]        output directory, seed, device, precision, evaluation, logging, checkpoints

``load_config("cpu-small", ["optimizer.lr=3e-3"])`` reads a preset (or a TOML path) and
applies overrides. Every field has a default; an unknown section or field is an error that
names it (with the closest known name).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.9/3.10 only
    import tomli as tomllib

__all__ = [
    "ModelConfig",
    "ModelSection",
    "DataSection",
    "OptimizerSection",
    "ScheduleSection",
    "RunSection",
    "TrainConfig",
    "ConfigError",
    "load_config",
    "preset_names",
    "preset_path",
    "to_toml",
    "adopt_model",
]

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
CONFIG_NAME = "config.toml"  # the resolved config inside a run directory


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the field."""


_MODEL_CHOICES = {
    "norm": ("rms", "layer", "none"),
    "norm_position": ("pre", "post"),
    "positions": ("rope", "sinusoidal", "learned", "none"),
    "ffn": ("swiglu", "silu", "relu2", "relu"),
    "attention": ("fast", "reference"),
}


@dataclass
class ModelConfig:
    """The Transformer's shape and switches: the [model] section of a training config and
    the argument of ``ferrolm.lm.model.TransformerLM`` (one definition for both).

    The first fields are the ``cs336`` recipe; every switch after them is off by default,
    and the default model is that recipe exactly (see ``TransformerLM``'s docstring for
    each switch's equation).

    - ``vocab_size``: 0 in a training config means the training shards' vocabulary size.
    - ``norm``: "rms" (RMSNorm everywhere), "layer" (LayerNorm, with a gain and a bias) or
      "none" (no normalization at all).
    - ``norm_position``: "pre" (h = x + Attn(N(x))) or "post" (h = N(x + Attn(x))).
    - ``positions``: "rope"; "sinusoidal" (the original Transformer's fixed table added to
      the token embeddings); "learned" (a (context_length, d_model) table added to them);
      or "none" (no positional information; causal masking alone).
    - ``ffn``: "swiglu" W2 (SiLU(W1 x) * W3 x), "silu" W2 SiLU(W1 x), "relu2"
      W2 relu(W1 x)^2 or "relu" W2 relu(W1 x) (the original Transformer's, without biases).
      The ungated FFNs have two matrices instead of three, so their hidden width is
      ``d_ff_ungated``, which when 0 is round(3 d_ff / 2): the parameter count of a
      SwiGLU of width d_ff.
    - ``dropout``: p in [0, 1): in training only, dropout on the embeddings' sum, on the
      attention weights and on each residual branch's output (attention and FFN); 0 is off.
    - ``label_smoothing``: e in [0, 1): the training loss's target is (1 - e) on the next
      token plus e / V on every token (torch's ``label_smoothing``); in training only, so
      validation losses stay comparable; 0 is off.
    - ``tie_embeddings``: one (vocab, d_model) matrix for the embedding and the LM head,
      initialized like the LM head (std sqrt(2/(vocab+d_model))).
    - ``attention``: "fast" (torch's fused SDPA) or "reference" (the literal equation).
    - ``num_kv_heads``: grouped-query attention, num_kv_heads key/value heads each shared
      by num_heads / num_kv_heads query heads; 0 means num_heads (plain multi-head).
    - ``qk_norm``: RMSNorm, with no weight, of each head's query and key after RoPE.
    - ``qk_norm_gain``: with ``qk_norm``, Qwen3's QK-norm instead: RMSNorm of each head's
      query and key times a learned (d_head,) gain (one for q, one for k, shared by the heads
      of a layer), before RoPE.
    - ``logit_softcap``: c > 0 maps the logits z to c tanh(z / c); 0 is off.
    - ``zero_init_output``: the attention output projection and the FFN's W2 start at
      zero, so each block starts as the identity.
    - ``doc_mask``: attention does not cross document boundaries (a document starts at
      the end-of-text token); training passes the documents of each row to the model.
    - ``value_embeds``: in the last layer and every second layer before it, the attention
      values add a learned embedding of the input token: v = x W_V^T + E_v[ids], with
      E_v a (vocab, num_kv_heads d_head) table of its own in each such layer.
    - ``x0_mix``: each block's input is a_i x + b_i x0, x0 the token embeddings and a_i,
      b_i two learned scalars per layer that start at 1 and 0 (the plain residual).
    - ``embed_norm``: the token embeddings are divided by their RMS, with no weight, before
      the first block (and x0 is the normalized embedding), as transformers' nanochat does.
    - ``unet_skips``: U-net skips, as in the modded-nanogpt speedrun: the outputs of the first
      floor(L/2) blocks are kept and block L-1-i reads x + s_i skip_i, skip_i the output of
      block i and s_i a learned scalar that starts at 1 (before ``x0_mix``'s mixing).
    - ``attn_gate``: each head's attention output is multiplied by sigmoid(x[:k] W_g^T)
      before W_O, x the attention's input, W_g a learned (num_heads, k) matrix per layer,
      k = min(12, d_model), starting at 0 (every gate at 1/2).
    - ``short_window``: w > 0 makes the layers that ``window_pattern`` marks 'S' attend
      only to the last w positions (the query's own included); 0 is off.
    - ``window_pattern``: 'L' (long: plain causal) and 'S' (short) cycled over the layers;
      the last layer is always long. Used only with ``short_window``.
    - ``smear``: token smearing: each position's embedding adds a gated share of the previous
      position's, x_t + lambda sigmoid(x_t[:k] . w) x_{t-1} with k = min(12, d_model), w a
      learned (k,) gate starting at 0 and lambda a learned scalar starting at 0 (so the model
      starts as without it); a sequence's first token, and with ``doc_mask`` a document's, is
      unchanged.
    - ``bigram_buckets``: B > 0 adds a learned embedding of the (previous, current) token pair:
      x_t + T[h(id_{t-1}, id_t)], T a zero-initialised (B, d_model) table and h a fixed hash
      into [0, B - 1); the first token (of the sequence, or of a document with ``doc_mask``)
      takes the reserved bucket B - 1. 0 is off; 1 is refused (no bucket left for pairs).
    - ``mtp_weight``, ``mtp_depth``: multi-token prediction as an auxiliary training loss;
      w > 0 adds, for j = 1..mtp_depth, w^j times the mean cross-entropy of the same logits
      against the token j positions further on (x_{t+1+j}); a target that falls off the row,
      is ignored (-100) or lies in a later document (with ``doc_mask``) does not count. No
      weights; in training only, so evaluation and validation losses stay next-token; 0 is off.
    """

    vocab_size: int = 0
    context_length: int = 256
    d_model: int = 512
    num_layers: int = 4
    num_heads: int = 16
    d_ff: int = 1344
    rope_theta: float = 10000.0
    norm: str = "rms"
    norm_position: str = "pre"
    positions: str = "rope"
    ffn: str = "swiglu"
    tie_embeddings: bool = False
    attention: str = "fast"
    d_ff_ungated: int = 0
    norm_eps: float = 1e-5
    num_kv_heads: int = 0
    qk_norm: bool = False
    logit_softcap: float = 0.0
    zero_init_output: bool = False
    doc_mask: bool = False
    value_embeds: bool = False
    x0_mix: bool = False
    dropout: float = 0.0
    label_smoothing: float = 0.0
    embed_norm: bool = False
    qk_norm_gain: bool = False
    unet_skips: bool = False
    attn_gate: bool = False
    short_window: int = 0
    window_pattern: str = "SSSL"
    # the switches that read the previous token
    smear: bool = False
    bigram_buckets: int = 0
    mtp_weight: float = 0.0
    mtp_depth: int = 1

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> ModelConfig:
        """Raise ValueError naming the first invalid field or relation (as ``model.NAME``)."""
        for name, allowed in _MODEL_CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"model.{name} must be one of {allowed}, got {value!r}")
        for name in ("context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{name} must be a positive int, got {value!r}")
        for name in ("vocab_size", "d_ff_ungated", "num_kv_heads", "short_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model.{name} must be an int >= 0, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"model.{name} must be a positive number, got {value}")
        if not (self.logit_softcap >= 0 and math.isfinite(self.logit_softcap)):
            raise ValueError(f"model.logit_softcap must be >= 0 (0: off), got {self.logit_softcap}")
        for name in ("dropout", "label_smoothing"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1):
                raise ValueError(f"model.{name} must be in [0, 1) (0: off), got {value!r}")
        weight, depth = self.mtp_weight, self.mtp_depth
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
            raise ValueError(f"model.mtp_weight must be in [0, 1] (0: off), got {weight!r}")
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth < self.context_length:
            raise ValueError(f"model.mtp_depth must be an int in [1, context_length - 1], got {depth!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.num_heads ({self.num_heads})")
        if self.positions == "rope" and self.d_head % 2:
            raise ValueError(f"RoPE needs an even head size: model.d_model / model.num_heads = {self.d_head}")
        b = self.bigram_buckets
        if not isinstance(b, int) or isinstance(b, bool) or b < 0 or b == 1:
            raise ValueError(f"model.bigram_buckets must be 0 (off) or an int >= 2 (one bucket is reserved), got {b!r}")
        if self.qk_norm_gain and not self.qk_norm:
            raise ValueError("model.qk_norm_gain needs model.qk_norm = true (it is a kind of QK-norm)")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"model.num_kv_heads ({self.num_kv_heads}) must divide model.num_heads ({self.num_heads})")
        if self.unet_skips and self.num_layers < 2:
            raise ValueError(
                f"model.unet_skips needs model.num_layers >= 2 (a skip joins two blocks), got {self.num_layers}"
            )
        pattern = self.window_pattern
        if not isinstance(pattern, str) or not pattern or set(pattern) - {"L", "S"}:
            raise ValueError(f"model.window_pattern must be a non-empty string of 'L' and 'S', got {pattern!r}")
        return self

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads when that is 0."""
        return self.num_kv_heads or self.num_heads

    @property
    def value_embed_layers(self) -> list[int]:
        """The layers with a value embedding (``value_embeds``): the last and every second one
        before it."""
        return list(range(self.num_layers - 1 - 2 * (self.num_value_embeds - 1), self.num_layers, 2))

    @property
    def num_value_embeds(self) -> int:
        """How many layers have a value embedding (counted without listing them)."""
        return (self.num_layers + 1) // 2 if self.value_embeds else 0

    @property
    def short_window_layers(self) -> list[int]:
        """The layers that attend over ``short_window`` positions only: those ``window_pattern``
        (cycled) marks 'S', never the last; none when short_window is 0."""
        if not self.short_window:
            return []
        pattern = self.window_pattern
        return [i for i in range(self.num_layers - 1) if pattern[i % len(pattern)] == "S"]

    @property
    def attn_gate_width(self) -> int:
        """k of ``attn_gate``: how many leading channels of the attention's input the gate reads."""
        return min(12, self.d_model)

    @property
    def ffn_hidden(self) -> int:
        """Width of the FFN's hidden layer for the chosen FFN."""
        if self.ffn == "swiglu":
            return self.d_ff
        return self.d_ff_ungated or round(3 * self.d_ff / 2)

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python dict (safe inside a ``weights_only=True`` checkpoint)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The config a dict describes; fields it lacks take their defaults (switches off),
        so configs saved before a switch existed read as the model they were."""
        d = dict(d)
        if "d_ff_silu" in d:  # the earlier name of d_ff_ungated
            d["d_ff_ungated"] = d.pop("d_ff_silu") or 0
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return cls(**d)


ModelSection = ModelConfig  # the [model] section is the model's own config


@dataclass
class DataSection:
    """Shards as written by `ferrolm encode`: a prefix, a .json/.bin path, a manifest, or a list."""

    train: Any = ""  # str or list of str
    val: Any = ""  # str or list of str
    tokenizer: str = ""  # optional tokenizer dir / fingerprint the shards must match
    dtype: str = ""  # uint16 / uint32 for .bin files without a sidecar (nanoGPT's train.bin)
    # "random": windows at uniform random positions; "documents": each row starts at a
    # document (its end-of-text token), documents packed best-fit (ferrolm.lm.data.DocumentRows)
    batching: str = "random"
    doc_buffer: int = 1000  # documents (or conversations) the best-fit packing chooses from
    # "auto": conversations when data.train names JSON Lines or Parquet files (.jsonl, .parquet,
    # .gz/.zst too), else token shards; "shards" or "conversations" to say which
    format: str = "auto"
    # conversations: the share of malformed rows (named in the log) a run still starts with; 0: none
    max_bad_share: float = 0.01


@dataclass
class OptimizerSection:
    lr: float = 1e-3  # peak learning rate (after warmup)
    min_lr: float = 1e-4  # learning rate at the end of the cosine
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only (not embeddings, not norm gains)
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    # "adamw": AdamW for every parameter. "muon": Muon for the blocks' hidden matrices (at
    # optimizer.lr, e.g. 0.02), AdamW (beta1, beta2, eps) for the rest at the lrs below;
    # weight_decay then applies to the LM head, muon_weight_decay to the hidden matrices.
    name: str = "adamw"
    muon_momentum: float = 0.95
    muon_momentum_start: float = 0.85  # momentum warm-up: from this to muon_momentum ...
    muon_momentum_warmup_steps: int = 300  # ... linearly over these first steps (0: none)
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    muon_weight_decay: float = 0.0
    muon_orthogonalizer: str = "newton-schulz"  # or "polar-express" (a quintic per step)
    normuon: bool = False  # NorMuon: each neuron's update by its running RMS, Muon's norm kept
    normuon_beta2: float = 0.95
    cautious_weight_decay: bool = False  # Muon's decay only where update and weight agree in sign
    # the bigram table's gradient as its read rows only; AdamW updates those rows and applies
    # an unread row's missed steps when it is next read or settled (AdamW._update_rows); one process only
    sparse_bigram: bool = False
    embedding_lr: float = 0.2  # muon: the AdamW groups' peak lrs, set for d_model 768 ...
    head_lr: float = 0.004
    scalar_lr: float = 0.02  # norm gains and other small parameters
    bigram_lr: float = 0.0  # the bigram table's own peak (0: embedding_lr's group)
    width_lr_scale: bool = True  # ... and multiplied by (768 / d_model)^0.5


@dataclass
class ScheduleSection:
    max_steps: int = 5000  # optimizer steps (the schedule's unit)
    warmup_steps: int = 100
    cosine_steps: int = 0  # the step where the cosine reaches min_lr; 0 means max_steps
    batch_size: int = 32  # sequences per micro-batch, per process
    tokens_per_step: int = 0  # tokens per optimizer step over all processes; 0: one micro-batch each
    max_time_s: float = 0.0  # stop after this much training time (s); 0: no limit
    schedule_by: str = "steps"  # "steps", or "time": the lr follows the fraction of max_time_s
    lr_schedule: str = "cosine"  # "cosine", or "wsd": warmup, stable at the peak, linear warm-down
    decay_frac: float = 0.2  # wsd: the warm-down's share of the schedule (it ends at cosine_steps or max_steps)
    # batch-size ramp: each micro-batch holds batch_ramp_start x batch_size rows (rounded) at step 0,
    # growing linearly to batch_size at step batch_ramp_steps (optimizer steps, also under
    # schedule_by = "time"); 0: off, every step the full batch
    batch_ramp_steps: int = 0
    batch_ramp_start: float = 0.25


@dataclass
class RunSection:
    out_dir: str = "runs/ferrolm"
    seed: int = 1337
    device: str = "auto"  # auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps
    num_threads: int = 0  # torch CPU threads (0: torch's default, one per core)
    # "auto", "true" or "false" (TOML booleans work too); see ferrolm.lm.device for "auto":
    autocast_bf16: str = "auto"  # bf16 autocast: auto = on CUDA, and on CPUs with native bf16 (AMX, AVX512-BF16)
    cpu_matmul: str = "auto"  # float32 GEMMs on a CPU: auto (measured at start), blas (torch's), onednn
    parallel: str = "ddp"  # under torchrun: "ddp" (weights replicated) or "fsdp" (sharded, FSDP2)
    compile: str = "auto"  # torch.compile model + loss: auto = on CUDA (on a CPU it measured level with eager)
    tf32: bool = True  # allow TF32 matmuls on CUDA
    eval_every: int = 200  # steps between validation evaluations (0: only at the end)
    eval_batches: int = 20  # fixed validation windows: eval_batches x batch_size of them
    eval_at_start: bool = True
    log_every: int = 10  # steps between JSONL records / progress updates
    checkpoint_every: int = 1000  # steps between checkpoints (0: only at the end / on a signal)
    keep_last: int = 2  # step checkpoints kept (older ones are deleted)
    keep_best: bool = True  # also keep best.pt, the checkpoint with the lowest val loss
    progress: bool = True  # tqdm progress bar
    wandb: str = ""  # wandb project name (logs there too when wandb is installed); "" = off
    tensorboard: bool = False  # also write TensorBoard scalars to out_dir/tb when installed
    # a new run starting from these weights (a ferrolm run folder, checkpoint or .safetensors
    # file, an exported or a Llama / Qwen3 / nanochat Hugging Face folder); "" = random init
    init_from: str = ""
    needs_init: bool = False  # refuse to start without init_from (a fine-tuning config: the sft preset)


SECTIONS = {
    "model": ModelConfig,
    "data": DataSection,
    "optimizer": OptimizerSection,
    "schedule": ScheduleSection,
    "run": RunSection,
}


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    run: RunSection = field(default_factory=RunSection)
    # "section.field" of every value a config file, preset or --set gave (not the defaults)
    given: set = field(default_factory=set, repr=False, compare=False)

    # -- conversion -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> TrainConfig:
        cfg = cls()
        cfg.update(d, source=source)
        return cfg

    def update(self, d: dict[str, Any], *, source: str = "config") -> None:
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a table of sections, got {type(d).__name__}")
        for section, values in d.items():
            if section not in SECTIONS:
                raise ConfigError(
                    f"{source}: unknown config section [{section}]{_suggest(section, SECTIONS)}; sections are {', '.join(SECTIONS)}"
                )
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{section}] must be a table, got {type(values).__name__}")
            for key, value in values.items():
                self.set(f"{section}.{key}", value, source=source)

    def set(self, dotted: str, value: Any, *, source: str = "override") -> None:
        """Set one field, ``section.name``, converting `value` to the field's type."""
        section, _, name = dotted.partition(".")
        if not name:
            # A bare field name is accepted when it names exactly one field.
            owners = [s for s, c in SECTIONS.items() if name_in(dotted, c)]
            if len(owners) == 1:
                section, name = owners[0], dotted
            else:
                raise ConfigError(
                    f"{source}: config field {dotted!r} must be written section.field{_suggest_dotted(dotted)}"
                )
        if section not in SECTIONS:
            raise ConfigError(
                f"{source}: unknown config section {section!r} in {dotted!r}{_suggest(section, SECTIONS)}; sections are {', '.join(SECTIONS)}"
            )
        obj = getattr(self, section)
        names = {f.name: f for f in dataclasses.fields(obj)}
        if name not in names:
            raise ConfigError(
                f"{source}: unknown config field '{section}.{name}'{_suggest(name, names, prefix=section + '.')}; "
                f"fields of [{section}]: {', '.join(names)}"
            )
        default = names[name].default
        setattr(obj, name, _coerce(f"{section}.{name}", value, default, source))
        self.given.add(f"{section}.{name}")

    # -- checks ----------------------------------------------------------------------------
    def validate(self) -> TrainConfig:
        """Check every field and their relations; raise ConfigError naming the first bad one."""
        _check_signs(self)
        _check_model(self.model)
        _check_optimizer(self.optimizer)
        _check_schedule(self.schedule, self.model)
        if self.run.cpu_matmul.lower() not in CPU_MATMUL_CHOICES:
            raise ConfigError(f"run.cpu_matmul must be one of {CPU_MATMUL_CHOICES}, got {self.run.cpu_matmul!r}")
        if self.run.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"run.parallel must be 'ddp' or 'fsdp', got {self.run.parallel!r}")
        for k in ("train", "val"):
            v = getattr(self.data, k)
            if isinstance(v, list) and not v:
                raise ConfigError(f"data.{k} is an empty list")
        if self.data.batching not in BATCHING_CHOICES:
            raise ConfigError(f"data.batching must be one of {BATCHING_CHOICES}, got {self.data.batching!r}")
        if self.data.format not in DATA_FORMAT_CHOICES:
            raise ConfigError(f"data.format must be one of {DATA_FORMAT_CHOICES}, got {self.data.format!r}")
        if not 0 <= self.data.max_bad_share <= 1:
            raise ConfigError(f"data.max_bad_share must be in [0, 1], got {self.data.max_bad_share}")
        if self.data.doc_buffer < 1:
            raise ConfigError(f"data.doc_buffer must be positive, got {self.data.doc_buffer}")
        if self.data.dtype not in ("", "uint16", "uint32"):
            raise ConfigError(
                f"data.dtype must be uint16 or uint32 (or empty: from the sidecar), got {self.data.dtype!r}"
            )
        return self

    def require_data(self) -> None:
        for k in ("train", "val"):
            if not getattr(self.data, k):
                raise ConfigError(f"data.{k} is not set: give the shard prefix, e.g. --set data.{k}=data/{k}")


def _check_signs(cfg: TrainConfig) -> None:
    m, s, o, r = cfg.model, cfg.schedule, cfg.optimizer, cfg.run
    positive = {
        "model.context_length": m.context_length,
        "model.d_model": m.d_model,
        "model.num_layers": m.num_layers,
        "model.num_heads": m.num_heads,
        "model.d_ff": m.d_ff,
        "schedule.max_steps": s.max_steps,
        "schedule.batch_size": s.batch_size,
        "run.log_every": r.log_every,
        "run.eval_batches": r.eval_batches,
    }
    for k, v in positive.items():
        if v <= 0:
            raise ConfigError(f"{k} must be positive, got {v}")
    non_negative = {
        "model.vocab_size": m.vocab_size,  # 0: from the shards
        "schedule.warmup_steps": s.warmup_steps,
        "schedule.cosine_steps": s.cosine_steps,
        "schedule.tokens_per_step": s.tokens_per_step,
        "schedule.max_time_s": s.max_time_s,
        "run.eval_every": r.eval_every,
        "run.checkpoint_every": r.checkpoint_every,
        "run.keep_last": r.keep_last,
        "run.num_threads": r.num_threads,
        "optimizer.weight_decay": o.weight_decay,
        "optimizer.grad_clip": o.grad_clip,
        "optimizer.min_lr": o.min_lr,
    }
    for k, v in non_negative.items():
        if not v >= 0 or (isinstance(v, float) and math.isinf(v)):  # NaN fails every comparison
            raise ConfigError(f"{k} must be >= 0, got {v}")
    if not 0 <= r.seed < SEED_LIMIT:
        raise ConfigError(f"run.seed must be an int in [0, 2**63), got {r.seed}")
    positive_numbers = {"optimizer.lr": o.lr, "optimizer.eps": o.eps, "model.rope_theta": m.rope_theta}
    for k, v in positive_numbers.items():
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"{k} must be a positive number, got {v}")


def _check_model(m: ModelConfig) -> None:
    try:
        m.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_optimizer(o: OptimizerSection) -> None:
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr ({o.min_lr}) is above optimizer.lr ({o.lr}): the cosine decays to min_lr")
    for k in ("beta1", "beta2", "muon_momentum", "muon_momentum_start"):
        if not 0 <= getattr(o, k) < 1:
            raise ConfigError(f"optimizer.{k} must be in [0, 1), got {getattr(o, k)}")
    if o.name not in OPTIMIZER_CHOICES:
        raise ConfigError(f"optimizer.name must be one of {OPTIMIZER_CHOICES}, got {o.name!r}")
    for k in ("embedding_lr", "head_lr", "scalar_lr"):
        if not (getattr(o, k) > 0 and math.isfinite(getattr(o, k))):
            raise ConfigError(f"optimizer.{k} must be a positive number, got {getattr(o, k)}")
    if not (o.bigram_lr >= 0 and math.isfinite(o.bigram_lr)):
        raise ConfigError(f"optimizer.bigram_lr must be 0 (embedding_lr) or a positive number, got {o.bigram_lr}")
    if o.muon_ns_steps < 1:
        raise ConfigError(f"optimizer.muon_ns_steps must be at least 1, got {o.muon_ns_steps}")
    if o.muon_orthogonalizer not in ("newton-schulz", "polar-express"):
        raise ConfigError(
            f"optimizer.muon_orthogonalizer must be 'newton-schulz' or 'polar-express', got {o.muon_orthogonalizer!r}"
        )
    if not 0 <= o.normuon_beta2 < 1:
        raise ConfigError(f"optimizer.normuon_beta2 must be in [0, 1), got {o.normuon_beta2}")
    for k in ("muon_weight_decay", "muon_momentum_warmup_steps"):
        if getattr(o, k) < 0:
            raise ConfigError(f"optimizer.{k} must be >= 0, got {getattr(o, k)}")


def _check_schedule(s: ScheduleSection, m: ModelConfig) -> None:
    if s.schedule_by not in ("steps", "time"):
        raise ConfigError(f"schedule.schedule_by must be 'steps' or 'time', got {s.schedule_by!r}")
    if s.lr_schedule not in LR_SCHEDULE_CHOICES:
        raise ConfigError(f"schedule.lr_schedule must be one of {LR_SCHEDULE_CHOICES}, got {s.lr_schedule!r}")
    if not 0 < s.decay_frac <= 1:
        raise ConfigError(f"schedule.decay_frac must be in (0, 1], got {s.decay_frac}")
    if s.schedule_by == "time" and s.max_time_s <= 0:
        raise ConfigError("schedule.schedule_by = 'time' needs schedule.max_time_s > 0")
    micro = s.batch_size * m.context_length
    if s.tokens_per_step % micro:
        lo = max(micro, s.tokens_per_step // micro * micro)
        raise ConfigError(
            f"schedule.tokens_per_step ({s.tokens_per_step}) is not a multiple of schedule.batch_size x "
            f"model.context_length = {micro}: use {lo} or {lo + micro} (or 0: one micro-batch per step)"
        )
    if s.batch_ramp_steps < 0:
        raise ConfigError(f"schedule.batch_ramp_steps must be >= 0 (0: off), got {s.batch_ramp_steps}")
    if not 0 < s.batch_ramp_start <= 1:
        raise ConfigError(
            f"schedule.batch_ramp_start must be in (0, 1] (a share of batch_size), got {s.batch_ramp_start}"
        )
    if s.warmup_steps > s.max_steps:
        raise ConfigError(f"schedule.warmup_steps ({s.warmup_steps}) exceeds schedule.max_steps ({s.max_steps})")
    if s.cosine_steps and s.cosine_steps < s.warmup_steps:
        raise ConfigError(f"schedule.cosine_steps ({s.cosine_steps}) is before the end of warmup ({s.warmup_steps})")


# [model] fields a run started from weights may set: they change no weight and only how it
# trains (attention kernel, document masking, an initialization the weights replace, a training
# loss, dropout: fine-tuning often regularizes what pretraining did not)
INIT_FREE_FIELDS = (
    "attention",
    "doc_mask",
    "zero_init_output",
    "mtp_weight",
    "mtp_depth",
    "dropout",
    "label_smoothing",
)


def adopt_model(cfg: TrainConfig, source: ModelConfig, name: str) -> None:
    """Make ``cfg.model`` the model of the weights read from ``name`` (``run.init_from``).
    A [model] value the config gave that contradicts the source is a ConfigError naming
    both; the fields of INIT_FREE_FIELDS keep the config's value, and model.context_length
    may be shorter than the source's (RoPE's tables are not weights); model.vocab_size = 0
    means the source's."""
    given = {k.split(".", 1)[1] for k in cfg.given if k.startswith("model.")}
    mine = cfg.model
    for k in sorted(given - set(INIT_FREE_FIELDS)):
        value, theirs = getattr(mine, k), getattr(source, k)
        if k == "num_kv_heads":  # 0 means num_heads: compare the heads each one means
            value, theirs = value or mine.num_heads, theirs or source.num_heads
        if value == theirs or (k == "vocab_size" and value == 0):
            continue
        if k == "context_length" and value <= theirs:
            continue
        what = "is longer than" if k == "context_length" else "contradicts"
        raise ConfigError(f"model.{k} = {value!r} {what} {theirs!r} of {name} (run.init_from)")
    keep = {k: getattr(mine, k) for k in INIT_FREE_FIELDS}
    if "context_length" in given:
        keep["context_length"] = mine.context_length
    cfg.model = dataclasses.replace(source, **keep)


def name_in(name: str, section_cls) -> bool:
    return any(f.name == name for f in dataclasses.fields(section_cls))


def _suggest(name: str, options: Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def _suggest_dotted(name: str) -> str:
    everything = [f"{s}.{f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c)]
    close = difflib.get_close_matches(name, [e.split(".", 1)[1] for e in everything], n=1, cutoff=0.6)
    if close:
        full = [e for e in everything if e.endswith("." + close[0])]
        return f" (did you mean '{full[0]}'?)"
    return ""


_SWITCHES = ("run.compile", "run.autocast_bf16")  # "auto" | "true" | "false"
SEED_LIMIT = 2**63  # seeds are ints in [0, SEED_LIMIT): what a torch.Generator takes, with room to add steps
CPU_MATMUL_CHOICES = ("auto", "blas", "onednn")  # run.cpu_matmul (see ferrolm.lm.gemm)
OPTIMIZER_CHOICES = ("adamw", "muon")  # optimizer.name
LR_SCHEDULE_CHOICES = ("cosine", "wsd")  # schedule.lr_schedule
BATCHING_CHOICES = ("random", "documents")  # data.batching
DATA_FORMAT_CHOICES = ("auto", "shards", "conversations")  # data.format


def _coerce(name: str, value: Any, default: Any, source: str) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{source}: {name} must be {expected}, got {value!r}")

    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise bad("true or false")
    if isinstance(default, int):
        if isinstance(value, bool):
            raise bad("an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                raise bad("an integer") from None
            if f.is_integer():
                return int(f)
        raise bad("an integer")
    if isinstance(default, float):
        if isinstance(value, bool):
            raise bad("a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad("a number") from None
        raise bad("a number")
    if name in ("data.train", "data.val"):
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad("a path or a list of paths")
    if name in _SWITCHES:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str) and value.lower() in ("auto", "true", "false"):
            return value.lower()
        raise bad('"auto", true or false')
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad("a string")
    return value


def _parse_value(text: str) -> Any:
    """A ``--set`` value: TOML syntax when it parses (numbers, booleans, lists, quoted strings), else the raw text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def preset_path(name: str) -> Path:
    path = PRESETS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(
            f"unknown preset {name!r}{_suggest(name, preset_names())}; presets: {', '.join(preset_names())}"
        )
    return path


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load_config(config: str | Path | None = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """A TrainConfig from a preset name or TOML path (None: defaults), then ``section.field=value`` overrides."""
    cfg = TrainConfig()
    if config is not None:
        path = Path(config)
        if path.is_file():
            cfg.update(read_toml(path), source=str(path))
        elif path.suffix == ".toml" or "/" in str(config) or path.exists():
            raise FileNotFoundError(f"config file not found: {config}")
        else:
            p = preset_path(str(config))
            cfg.update(read_toml(p), source=f"preset {config}")
    apply_overrides(cfg, overrides)
    return cfg.validate()


def resume_config(
    config: str | Path | None, overrides: Iterable[str] = (), resume: str | Path | None = None
) -> TrainConfig:
    """The config of a run that ``resume`` (a run folder or one of its checkpoints) continues:
    ``config`` when given, else the run's own config.toml, with its ``run.out_dir`` set to
    the run folder; then ``overrides``. Without ``resume``: ``load_config(config, overrides)``."""
    overrides = list(overrides)
    if resume is not None and not Path(resume).exists():
        raise FileNotFoundError(f"--resume {resume}: no such run directory or checkpoint")
    if resume is not None and config is None:
        rdir = Path(resume)
        if not rdir.is_dir():  # a checkpoint file: RUN/checkpoints/step_N.pt or RUN/best.pt
            rdir = rdir.parent.parent if rdir.parent.name == "checkpoints" else rdir.parent
        config = rdir / CONFIG_NAME
        if not config.is_file():
            raise FileNotFoundError(f"--resume {resume}: {config} not found (pass --config too)")
        overrides = [f"run.out_dir={rdir}"] + overrides
    return load_config(config, overrides)


def apply_overrides(cfg: TrainConfig, overrides: Iterable[str]) -> TrainConfig:
    for item in overrides:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.field=value, e.g. optimizer.lr=3e-4")
        cfg.set(key.strip(), _parse_value(text.strip()), source=f"--set {key.strip()}")
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return {True: "inf", False: "-inf"}[v > 0] if math.isinf(v) else "nan"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML text (read back by load_config to the same TrainConfig)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)
