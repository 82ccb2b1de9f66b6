"""The shape of a decoder-only causal LM, per family: what the memory model needs to know.

A :class:`ModelShape` holds the sizes of one architecture (never its weights) and the
family traits that change what a step stores: q/k norms (Qwen3, Gemma 3), four norms per
layer (Gemma 2/3), fused projections (Phi-3's ``qkv_proj`` and ``gate_up_proj``), sliding-
window layers (Mistral, Phi-3, Gemma 2/3), attention logit soft-capping (Gemma 2, which
transformers runs in eager attention: it has no SDPA path for the soft-cap), a soft-capped
LM head (Gemma 2), and mixture-of-experts MLPs (Mixtral, Qwen3-MoE: E experts, top-k
routed, stored per expert). :data:`FAMILIES` lists the modelled ``model_type`` values.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types names


@dataclass(frozen=True)
class Family:
    """What a ``model_type``'s decoder layer has beyond the Llama layer.

    Attributes:
        qk_norm: An RMSNorm on each head of q and of k before the rotary embedding.
        norms: RMSNorms per layer (2; Gemma 2/3: 4, before and after attention and MLP).
        fused: ``qkv_proj`` and ``gate_up_proj`` instead of q/k/v and gate/up (Phi-3).
        moe: The MLP is a mixture of experts (transformers' fused-experts layout).
        qkv_bias: q/k/v have a bias whatever the config says (Qwen2).
        hf_class: The transformers causal-LM class (for ``--verify`` and the tests).
    """

    qk_norm: bool = False
    norms: int = 2
    fused: bool = False
    moe: bool = False
    qkv_bias: bool = False
    hf_class: str = "LlamaForCausalLM"


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(hf_class="MistralForCausalLM"),
    "qwen2": Family(qkv_bias=True, hf_class="Qwen2ForCausalLM"),
    "qwen3": Family(qk_norm=True, hf_class="Qwen3ForCausalLM"),
    "gemma": Family(hf_class="GemmaForCausalLM"),
    "gemma2": Family(norms=4, hf_class="Gemma2ForCausalLM"),
    "gemma3": Family(qk_norm=True, norms=4, hf_class="Gemma3ForCausalLM"),
    "phi3": Family(fused=True, hf_class="Phi3ForCausalLM"),
    "mixtral": Family(moe=True, hf_class="MixtralForCausalLM"),
    "qwen3_moe": Family(qk_norm=True, moe=True, hf_class="Qwen3MoeForCausalLM"),
}

LLAMA_LINEARS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
# every projection name any modelled family has (what a LoRA target may be called)
KNOWN_WEIGHTS: tuple[str, ...] = (*LLAMA_LINEARS, "qkv_proj", "gate_up_proj")
MLP_WEIGHTS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


@dataclass(frozen=True)
class ModelShape:
    """Sizes and family traits of a decoder-only causal LM.

    Attributes:
        name: Preset name or the config file it came from.
        hidden: Hidden size h.
        intermediate: MLP intermediate size (a MoE model: each expert's).
        layers: Number of decoder layers.
        heads: Attention (query) heads.
        kv_heads: Key/value heads (fewer than ``heads`` under grouped-query attention).
        vocab: Vocabulary size (rows of the embedding and the LM head).
        tie_embeddings: The LM head shares the embedding matrix.
        head_dim: Per-head size (``hidden // heads`` unless the config says otherwise, as
            Gemma's and Qwen3's do).
        qkv_bias: q/k/v projections have a bias.
        max_positions: Longest sequence the model supports (``max_position_embeddings``).
        family: The ``model_type`` (a key of :data:`FAMILIES`).
        sliding_window: Tokens a sliding-window layer attends to (``None``: none).
        layer_types: Per layer ``"full_attention"`` or ``"sliding_attention"``
            (transformers' names); empty: every layer full, or every layer sliding when
            ``sliding_window`` is set.
        attn_softcap: Attention logits soft-capped (Gemma 2): transformers runs eager
            attention, which keeps the heads' score matrices.
        final_softcap: The LM head's logits soft-capped before the loss (Gemma 2).
        experts: Experts per MoE layer (0: a dense MLP).
        experts_per_token: Experts each token is routed to (top-k).
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool = False
    head_dim: int = 0
    qkv_bias: bool = False
    max_positions: int = 4096
    family: str = "llama"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attn_softcap: float | None = None
    final_softcap: float | None = None
    experts: int = 0
    experts_per_token: int = 0

    def __post_init__(self) -> None:
        for field in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab",
                      "max_positions"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"model {self.name!r}: {field} must be a positive integer, got {value!r}; "
                    "check the config."
                )
        if self.family not in FAMILIES:
            raise ValueError(f"model {self.name!r}: family {self.family!r} is not modelled; "
                             f"choose one of {', '.join(FAMILIES)}.")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_attention_heads={self.heads} is not a multiple of "
                f"num_key_value_heads={self.kv_heads}; check the config."
            )
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ValueError(
                    f"model {self.name!r}: hidden_size={self.hidden} is not divisible by "
                    f"num_attention_heads={self.heads}; give head_dim in the config."
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        self._check_layers()
        if self.traits.qkv_bias:
            object.__setattr__(self, "qkv_bias", True)

    def _check_layers(self) -> None:
        if self.layer_types:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = sorted(set(self.layer_types) - {FULL, SLIDING})
            if len(self.layer_types) != self.layers or bad:
                raise ValueError(
                    f"model {self.name!r}: layer_types must name {self.layers} layers, each "
                    f"{FULL!r} or {SLIDING!r}; got {len(self.layer_types)}"
                    + (f" with {bad}" if bad else "") + "; check the config.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model {self.name!r}: sliding_window must be >= 1 or null, got "
                             f"{self.sliding_window}.")
        moe = self.traits.moe
        if moe and not 0 < self.experts_per_token <= self.experts:
            raise ValueError(
                f"model {self.name!r}: a {self.family} model needs num_experts >= "
                f"num_experts_per_tok >= 1, got {self.experts} and {self.experts_per_token}.")
        if not moe and self.experts:
            raise ValueError(f"model {self.name!r}: {self.family} has no experts; "
                             f"experts={self.experts} belongs to a MoE family (mixtral, qwen3_moe).")

    # -- traits and layers ---------------------------------------------------------

    @property
    def traits(self) -> Family:
        return FAMILIES[self.family]

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def eager_attention(self) -> bool:
        """transformers runs eager attention (no SDPA path for an attention soft-cap)."""
        return self.attn_softcap is not None

    @property
    def attention_kinds(self) -> int:
        """Attention types among the layers: 2 where some slide and some attend globally."""
        return len({self.sliding(i) for i in range(self.layers)})

    @property
    def rotary_kinds(self) -> int:
        """Rotary tables transformers keeps: one per attention type in Gemma 3 (its local
        and global layers differ), else one."""
        return self.attention_kinds if self.family == "gemma3" else 1

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends through a sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types[layer] == SLIDING if self.layer_types else True

    def masked(self, layer: int, seq_len: int) -> bool:
        """Whether ``layer`` gets an explicit attention mask at ``seq_len`` tokens.

        SDPA runs causal without a mask unless the window is shorter than the sequence
        (transformers' ``sdpa_mask`` skips it then); eager attention always takes one.
        """
        return self.eager_attention or (self.sliding(layer) and seq_len > self.sliding_window)

    @property
    def q_size(self) -> int:
        """Width of the query projection's output."""
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output."""
        return self.kv_heads * self.head_dim

    # -- weights ---------------------------------------------------------------------

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each linear layer in one decoder layer
        (a MoE layer's experts are :meth:`expert_shapes`; its router is no linear layer)."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_size, self.kv_size
        if self.traits.fused:
            attn = {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h)}
        else:
            attn = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.is_moe:
            return attn
        if self.traits.fused:
            return {**attn, "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        return {**attn, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of one expert's projections (transformers' fused-experts names)."""
        if not self.is_moe:
            return {}
        h, i = self.hidden, self.intermediate
        return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}

    def weight_shapes(self) -> dict[str, tuple[int, int, int]]:
        """``(in, out, copies)`` of every adaptable weight of a layer: linears once, each
        expert projection ``experts`` times."""
        out = {n: (a, b, 1) for n, (a, b) in self.linear_shapes().items()}
        out.update({n: (a, b, self.experts) for n, (a, b) in self.expert_shapes().items()})
        return out

    def _per_layer(self, *, active: bool) -> int:
        experts = self.experts_per_token if active else self.experts
        n = sum(a * b for a, b in self.linear_shapes().values())
        n += experts * sum(a * b for a, b in self.expert_shapes().values())
        n += self.traits.norms * self.hidden + (2 * self.head_dim if self.traits.qk_norm else 0)
        n += self.experts * self.hidden  # the router
        if self.qkv_bias:
            n += self.q_size + 2 * self.kv_size
        return n

    def num_params(self) -> int:
        """Total parameter count (embeddings, layers, norms, head)."""
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return (self.vocab * self.hidden + self.layers * self._per_layer(active=False)
                + self.hidden + head)

    def active_params(self) -> int:
        """Parameters one token's forward uses: a MoE layer's top-k experts, not all E."""
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return (self.vocab * self.hidden + self.layers * self._per_layer(active=True)
                + self.hidden + head)

    def describe(self) -> str:
        """One line: the family and the sizes the plan table's header prints."""
        s = (f"{self.family}: {self.num_params() / 1e9:.2f} B params")
        if self.is_moe:
            s += (f" ({self.active_params() / 1e9:.2f} B active: {self.experts_per_token} of "
                  f"{self.experts} experts)")
        s += (f", {self.layers} layers, hidden {self.hidden}, intermediate {self.intermediate}"
              f", heads {self.heads}/{self.kv_heads} kv")
        if self.head_dim * self.heads != self.hidden:
            s += f" x {self.head_dim}"
        s += f", vocab {self.vocab}"
        if self.tie_embeddings:
            s += ", tied embeddings"
        if self.sliding_window is not None:
            n = sum(self.sliding(i) for i in range(self.layers))
            s += f", window {self.sliding_window} on {n}/{self.layers} layers"
        if self.attn_softcap is not None:
            s += ", soft-capped (eager) attention"
        return s
