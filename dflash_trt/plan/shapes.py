"""What the planner and the cost model know of a model: its parameter groups (each with one weight format
and one tensor-parallel rule) and the shape of its attention, from config.json alone (planner.target_shape,
planner.drafter_shape)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Group:
    """One family of tensors with the same format and the same tensor-parallel rule."""
    name: str
    elements: int          # whole model
    split: str             # "tp" (divided by tp), "kv" (per-head, duplicated past kv_heads), "rep"
    quantizable: bool      # a linear-layer weight that FP8 / NVFP4 (or MXFP4 for experts) applies to
    linears: int = 0       # number of linear modules (for per-tensor scale bytes)
    expert: bool = False
    kv_heads: int = 0      # for split == "kv": heads in the tensor
    active_fraction: float = 1.0   # share of it a token touches (experts: k / E)


@dataclass
class ModelShape:
    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    experts: int = 0
    experts_per_token: int = 0
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    native_format: str = "none"
    groups: list[Group] = field(default_factory=list)
    has_embedding: bool = True
    # (KV heads, head_dim) of each attention layer where they differ by layer (Gemma 4); None: every
    # layer has kv_heads x head_dim
    kv_per_layer: list[tuple[int, int]] | None = None

    @property
    def total_params(self) -> int:
        return sum(g.elements for g in self.groups)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward pass multiplies by: the embedding table is a lookup and
        is not counted (the convention of the gpt-oss model card); lm_head is (tied or not)."""
        n = 0
        for g in self.groups:
            if g.name == "embed":
                continue
            n += round(g.elements * g.active_fraction)
        if not any(g.name == "lm_head" for g in self.groups) and self.has_embedding:
            n += self.vocab * self.hidden        # tied lm_head: the embedding matrix is multiplied
        return n

    def output_projection(self) -> Group:
        """The output projection (the embedding when tied), which a DFlash drafter borrows."""
        return next((g for g in self.groups if g.name == "lm_head"),
                    Group("lm_head", self.vocab * self.hidden, "tp", False))

    @property
    def full_layers(self) -> int:
        return sum(1 for t in self.layer_types if t != "sliding_attention")

    @property
    def sliding_layers(self) -> int:
        return self.layers - self.full_layers
