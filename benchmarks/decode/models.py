"""The two decode models' architectures, as the per-chip composition needs them (published configs' figures), and the
v6e-8 layout they run in: expert parallelism over the 8 chips, attention, dense layers and lm_head replicated.

A layer kind is one attention shape (Qwen3 has one; Gemma 4 a sliding and a full one); each model step runs
`count` layers of each kind, every one with the MoE block (Gemma 4's with a dense MLP beside it).
"""

from __future__ import annotations

import dataclasses

CHIPS = 8  # v6e-8: one TensorCore per chip, a 2x4 ICI torus
TOPOLOGY = "v6e:2x4"
BATCHES = (1, 8, 16, 32, 64, 128, 256)
CONTEXTS = (768, 4096, 32768)  # 768: the published setup's last step (prefill 256 + 512 new tokens)
# Our paged cache's page size (tokens): transformers' continuous batching default; 4x fewer page copies than 64 at the
# same bytes (modeled v6e, Qwen3 decode at context 768, B = 64: 94.6 -> 91.5 us a layer of attention).
PAGE = 256


@dataclasses.dataclass(frozen=True)
class LayerKind:
    name: str  # also the attention shape's name in benchmarks/shapes.py (paged attention, rotary)
    count: int  # layers of this kind in the model
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int  # keys a query sees (itself included); -1: the whole context
    k_eq_v: bool  # one projection serves as keys and values (Gemma 4's full layers)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V cache bytes of one token in this layer (bf16; both stored even when K = V, as the caches are)."""
        return 2 * self.kv_heads * self.head_dim * 2

    def keys(self, context: int) -> int:
        return context if self.window <= 0 else min(context, self.window)


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    hub_id: str
    hidden: int
    vocab: int
    tied_embeddings: bool
    experts: int
    top_k: int
    expert_intermediate: int
    activation: str  # the experts' (and dense MLP's) activation: "silu" | "gelu_tanh"
    dense_intermediate: int  # a dense MLP beside the MoE block (0: none)
    norms_per_layer: int  # hidden-size RMSNorms a layer runs (besides the per-head q/k norms)
    kinds: tuple[LayerKind, ...]

    @property
    def layers(self) -> int:
        return sum(k.count for k in self.kinds)

    @property
    def local_experts(self) -> int:
        return self.experts // CHIPS

    def expert_bytes(self) -> int:
        """One expert's gate/up and down weights (bf16)."""
        return 3 * self.hidden * self.expert_intermediate * 2

    def attention_weight_bytes(self, kind: LayerKind) -> int:
        q = kind.q_heads * kind.head_dim
        kv = kind.kv_heads * kind.head_dim * (1 if kind.k_eq_v else 2)
        return self.hidden * (2 * q + kv) * 2

    def dense_bytes_per_layer(self, kind: LayerKind) -> int:
        """Weights every chip reads in each layer besides the experts: attention, the router, the dense MLP."""
        return (
            self.attention_weight_bytes(kind)
            + self.hidden * self.experts * 2
            + 3 * self.hidden * self.dense_intermediate * 2
        )

    def weight_bytes_per_chip(self) -> int:
        """Every weight a chip holds: replicated layers + its experts + embeddings (+ lm_head when untied)."""
        per_layer = sum(k.count * self.dense_bytes_per_layer(k) for k in self.kinds)
        experts = self.layers * self.local_experts * self.expert_bytes()
        embeddings = self.vocab * self.hidden * 2 * (1 if self.tied_embeddings else 2)
        return per_layer + experts + embeddings

    def kv_bytes_per_chip(self, batch: int, context: int) -> int:
        """The KV caches of every layer (replicated on every chip, as attention is)."""
        return sum(k.count * batch * k.keys(context) * k.kv_bytes_per_token for k in self.kinds)


QWEN3 = Model(
    name="qwen3-30b-a3b",
    hub_id="Qwen/Qwen3-30B-A3B",
    hidden=2048,
    vocab=151936,
    tied_embeddings=False,
    experts=128,
    top_k=8,
    expert_intermediate=768,
    activation="silu",
    dense_intermediate=0,
    norms_per_layer=2,
    kinds=(LayerKind("qwen3-30b-a3b", 48, 32, 4, 128, -1, False),),
)

GEMMA4 = Model(
    name="gemma4-26b-a4b",
    hub_id="google/gemma-4-26B-A4B",
    hidden=2816,
    vocab=262144,
    tied_embeddings=True,
    experts=128,
    top_k=8,
    expert_intermediate=704,
    activation="gelu_tanh",
    dense_intermediate=2112,
    norms_per_layer=7,  # input, post-attention, pre/post feed-forward, the MoE's pre/post norms and their sum's
    kinds=(
        LayerKind("gemma4-sliding", 25, 16, 8, 256, 1024, False),
        LayerKind("gemma4-full", 5, 16, 2, 512, -1, True),
    ),
)

MODELS = {m.name: m for m in (QWEN3, GEMMA4)}

# gpt-oss-20b, in the one-chip decode step only (chip_step.py; the v6e-8 composition, MODELS, has Qwen3 and Gemma 4):
# sliding (window 128) and full layers alternating, 64 q / 8 kv heads of 64, sinks, biased projections, no per-head
# q/k norm, 32 experts top-4 of 2880 x 2880 in its checkpoint's MXFP4, gate/up interleaved, the clamped SwiGLU. Its
# experts' biases are left out (as in benchmarks/ops/moe.py); XLA's path multiplies the bf16 weights transformers
# dequantizes the MXFP4 ones to on a TPU.
GPT_OSS = Model(
    name="gpt-oss-20b",
    hub_id="openai/gpt-oss-20b",
    hidden=2880,
    vocab=201088,
    tied_embeddings=False,
    experts=32,
    top_k=4,
    expert_intermediate=2880,
    activation="clamped_swiglu",
    dense_intermediate=0,
    norms_per_layer=2,
    kinds=(
        LayerKind("gpt-oss-sliding", 12, 64, 8, 64, 128, False),
        LayerKind("gpt-oss-full", 12, 64, 8, 64, -1, False),
    ),
)
