"""The shell every runtime target model shares (models/families): what a family does not change.

A family module builds its decoder (`Backbone`: Hugging Face names) and subclasses TargetShell, which
gives it the interface runtime/decode.py drives (models/families/__init__.py): the head, the KV caches,
and a forward that runs the family's `decode` generator. Also `hf_config` and `text_config`.
"""
from __future__ import annotations

import torch
from torch import nn

from dflash_trt.errors import DFlashError
from dflash_trt.models.attention import pad_to_chunks
from dflash_trt.models.config import decoder_config
from dflash_trt.models.layers import Linear, RMSNorm, RopeTable, linear

# config.json fields that are no transformers config arguments
NOT_CONFIG_FIELDS = ("model_type", "transformers_version", "quantization_config", "auto_map", "architectures")


def hf_config(cfg: dict):
    """The transformers config object of a config.json dict (for its model_type)."""
    from transformers import AutoConfig

    mt = cfg.get("model_type")
    kw = {k: v for k, v in cfg.items() if k not in NOT_CONFIG_FIELDS}
    try:
        return AutoConfig.for_model(mt, **kw)
    except Exception as e:  # noqa: BLE001  transformers validates fields with many exception types
        msg = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise DFlashError(f"config.json: transformers refuses this {mt} config ({msg})") from None


def text_config(cfg: dict, wrappers: dict[str, str]) -> tuple[dict, str]:
    """The decoder's config.json fields (model_type: its decoder's, as the wrapper's transformers
    config builds it) and the checkpoint prefix of its tensors. `wrappers`: a family's multimodal
    model types -> their text decoder's model type."""
    mt = cfg.get("model_type")
    if mt not in wrappers:
        return cfg, "model."
    tc = decoder_config(cfg)
    if tc is cfg:
        raise DFlashError(f"config.json: model_type {mt!r} keeps its decoder's fields in text_config, which is missing")
    return {**tc, "model_type": wrappers[mt]}, "model.language_model."


class Backbone(nn.Module):
    """The decoder: embed_tokens, layers (layer(i) for each), the final norm."""

    def __init__(self, c, layer, norm=RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layer(i) for i in range(c.num_hidden_layers))
        self.norm = norm(c.hidden_size, c.rms_norm_eps)


class TargetShell(nn.Module):
    """The target model's interface (models/families), less what a family defines: in __init__,
    `self.hf` (the decoder's transformers config), then `finish(model, tied, dtype, max_len)`;
    `decode` where the layers take more than (x, cos, sin, start, mask)."""

    softcap: float | None = None          # final logits: softcap * tanh(logits / softcap) (Gemma 4)
    placeholders: tuple[int, ...] = ()   # a multimodal wrapper's image / video / audio placeholder ids,
    placeholder_id = 0                   # embedded as this id in text-only input, as the wrapper does

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.max_len = 0

    def finish(self, model: nn.Module, tied: bool, dtype: torch.dtype, max_len: int) -> None:
        c = self.hf
        self.model = model
        self.tied = tied
        if not tied:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rope = self.rope_table(max(max_len, 1), dtype)
        self.num_layers, self.hidden_size, self.vocab_size = c.num_hidden_layers, c.hidden_size, c.vocab_size
        self.to(dtype)

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.dtype

    def lm_head_weight(self):
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = linear(h, self.lm_head_weight())   # a tied embedding gets its packed copy too
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def rope_table(self, max_len: int, dtype: torch.dtype):
        return RopeTable(self.hf, max_len, dtype)

    def kv_layers(self) -> list[nn.Module]:
        """The attentions that own a K/V cache (models/attention.CachedAttention)."""
        return [layer.self_attn for layer in self.model.layers]

    def cache_bytes_per_position(self) -> int:
        return sum(2 * a.nkv * a.hd * self.dtype.itemsize for a in self.kv_layers())

    def setup_cache(self, max_len: int):
        """Allocate (or keep, if large enough) the static KV cache."""
        if max_len <= self.max_len:
            return
        max_len = pad_to_chunks(max_len)  # whole KV_PAD chunks: see CachedAttention.attend_cached
        if max_len > self.rope.length:
            self.rope = self.rope_table(max_len, self.dtype)
        self.allocate_cache(max_len)
        self.max_len = max_len

    def allocate_cache(self, max_len: int) -> None:
        for a in self.kv_layers():
            a.k_cache = torch.zeros(a.nkv, max_len, a.hd, dtype=self.dtype)
            a.v_cache = torch.zeros(a.nkv, max_len, a.hd, dtype=self.dtype)

    def text_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens as the decoder embeds them: a wrapper's placeholder ids (no image / video / audio
        here: text-only input) become placeholder_id."""
        if not self.placeholders:
            return tokens
        return torch.where(torch.isin(tokens, torch.tensor(self.placeholders)), self.placeholder_id, tokens)

    def decode(self, tokens, x, start: int, pos, mask):
        """The decoder layers over x [T, H] (embedded `tokens` at positions `pos`): yields each layer's output."""
        cos, sin = self.rope(pos)
        for layer in self.model.layers:
            x = layer(x, cos, sin, start, mask)
            yield x

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, capture: list[int] = (), all_logits: bool = False):
        """tokens [T] at positions [start, start+T). Returns (logits [T or 1, V], features [T, len(capture)*H]).
        features are the outputs of the captured decoder layers (HF hidden_states[i + 1])."""
        T = tokens.shape[0]
        if start + T > self.max_len:
            raise DFlashError(f"sequence of {start + T} tokens exceeds the KV cache ({self.max_len}); raise max_len")
        pos = torch.arange(start, start + T)
        mask = torch.arange(start + T)[None, :] <= pos[:, None]
        tokens = self.text_ids(tokens)
        x = self.embed(tokens)
        feats, last = {}, self.num_layers - 1
        for i, x in enumerate(self.decode(tokens, x, start, pos, mask)):
            if i in capture and i != last:
                feats[i] = x
        x = self.model.norm(x)
        if last in capture:  # HF's last hidden state is taken after the final norm
            feats[last] = x
        logits = self.logits(x if all_logits else x[-1:])
        return logits, (torch.cat([feats[i] for i in capture], dim=-1) if capture else None)
