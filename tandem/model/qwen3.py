"""Qwen3 decoder, dense or mixture-of-experts (`tandem.model.moe`). Parameter names equal Hugging Face's
`Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`, so a trainer's state dict maps 1:1 onto the engine's.

The model works on a flat batch: `input_ids` [T] and `positions` [T] of all sequences' new tokens back to
back; where each token's keys and values come from and go to is the `AttentionContext`'s business.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelHead,
    layouts,
    shard_into,
)
from tandem.model.attention import AttentionContext, Fresh
from tandem.model.moe import Qwen3Experts, Qwen3SparseMoeBlock


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None  # a fused (x, weight, eps) -> y, see `Qwen3ForCausalLM.use_training_kernels`

    def forward(self, x):
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions_T: torch.Tensor, head_dim: int, theta: float):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions_T.device)
                               .float() / head_dim)
    freqs_TF = positions_T.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs_TF, freqs_TF], dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]  # [T, 1, D], broadcast over heads


def apply_rope(x_THD, cos, sin):
    half = x_THD.shape[-1] // 2
    rotated = torch.cat([-x_THD[..., half:], x_THD[..., :half]], dim=-1)
    return (x_THD * cos + rotated * sin).to(x_THD.dtype)


def silu_mul(gate, up):
    return F.silu(gate) * up


class Qwen3Attention(nn.Module):
    """Under tensor parallelism each rank holds num_heads / tp query heads and num_kv_heads / tp KV heads."""

    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.layer = layer
        H, K, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads = tp.split(H, "num_attention_heads")
        self.num_kv_heads = tp.split(K, "num_key_value_heads")
        self.head_dim = D
        hidden = config.hidden_size
        self.q_proj = ColumnParallelLinear(hidden, H * D, tp, "num_attention_heads")
        self.k_proj = ColumnParallelLinear(hidden, K * D, tp, "num_key_value_heads")
        self.v_proj = ColumnParallelLinear(hidden, K * D, tp, "num_key_value_heads")
        self.o_proj = RowParallelLinear(H * D, hidden, tp, "num_attention_heads")
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rope = apply_rope

    def qkv(self, x_TE, cos, sin):
        """Queries, keys (normalised, rotated) and values, [T, heads, D] each."""
        T = x_TE.shape[0]
        q = self.q_norm(self.q_proj(x_TE).view(T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x_TE).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_TE).view(T, self.num_kv_heads, self.head_dim)
        return self.rope(q, cos, sin), self.rope(k, cos, sin), v


class Qwen3MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = ColumnParallelLinear(hidden, inter, tp, "intermediate_size")
        self.up_proj = ColumnParallelLinear(hidden, inter, tp, "intermediate_size")
        self.down_proj = RowParallelLinear(inter, hidden, tp, "intermediate_size")
        self.silu_mul = silu_mul

    def forward(self, x):
        return self.down_proj(self.silu_mul(self.gate_proj(x), self.up_proj(x)))


def attention_inputs(layer: Qwen3DecoderLayer, x_TE, cos, sin):
    """A decoder layer up to its attention: the queries, keys and values of `layer.self_attn.qkv`."""
    return layer.self_attn.qkv(layer.input_layernorm(x_TE), cos, sin)


def attention_output_and_mlp(layer: Qwen3DecoderLayer, x_TE, o_THD):
    """A decoder layer after its attention (output `o_THD`): the layer's output."""
    x_TE = x_TE + layer.self_attn.o_proj(o_THD.reshape(x_TE.shape[0], -1))
    return x_TE + layer.mlp(layer.post_attention_layernorm(x_TE))


@functools.cache
def compiled_regions(backend: str = "inductor") -> tuple:
    """The two regions around attention compiled (`torch.compile`, dynamic shapes), once per process. The layer
    is an argument whose parameters become graph inputs, so one graph serves every layer."""
    return tuple(torch.compile(fn, dynamic=True, backend=backend) for fn in (attention_inputs,
                                                                           attention_output_and_mlp))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup = SINGLE, ep: TPGroup = SINGLE):
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer, tp)
        self.mlp = Qwen3SparseMoeBlock(config, layer, ep) if config.is_sparse(layer) else Qwen3MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.regions = (attention_inputs, attention_output_and_mlp)  # see `Qwen3ForCausalLM.compile_layers`

    def forward(self, x, cos, sin, ctx: AttentionContext):
        before, after = self.regions
        q, k, v = before(self, x, cos, sin)
        return after(self, x, ctx.attend(self.self_attn.layer, q, k, v))


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, ep: TPGroup = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i, tp, ep) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@torch.no_grad()
def _concatenate_as_views(*linears: nn.Linear) -> torch.Tensor:
    """One matrix of the linears' weights stacked by output row; each weight's data becomes its view of it."""
    matrix = torch.cat([linear.weight for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = matrix[start:start + rows]
        start += rows
    return matrix


class Qwen3ForCausalLM(nn.Module):
    """`tp`: the group the dense layers (attention, dense MLPs, embedding, head) are split over; `ep`: the group a
    mixture-of-experts model's experts are split over. The defaults are one rank (the whole model)."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, ep: TPGroup = SINGLE):
        super().__init__()
        self.config, self.tp, self.ep = config, tp, ep
        self.model = Qwen3Model(config, tp, ep)
        self.moe_blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, Qwen3SparseMoeBlock)]
        self.routing_checksum: torch.Tensor | None = None  # see `keep_routing_checksum`
        self.routing_store: torch.Tensor | None = None  # see `capture_routing`
        self.kv_sums = None  # see `capture_kv_sums`
        self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    fused = None  # tandem.kernels.fused when `use_fused_kernels()` was called (GPU inference)
    small = None  # tandem.kernels.small_linear, for steps of few rows, where `use_fused_kernels()` can use it

    def capture_routing(self, store: torch.Tensor) -> None:
        """Have every forward over a KV cache write each token's expert ids, per MoE layer, into `store`
        [S, num_hidden_layers, k] at the token's cache slot (`AttentionContext.token_slots`)."""
        self.routing_store = store

    def capture_kv_sums(self, record) -> None:
        """Have every forward over a KV cache call `record(slots)` once every layer's keys and values are in the
        cache (`slots`: the step's, `AttentionContext.token_slots`): `KVPool.record_sums`."""
        self.kv_sums = record

    def _set_capture(self, ctx: AttentionContext) -> None:
        slots = ctx.token_slots() if self.routing_store is not None else None
        for block in self.moe_blocks:
            block.capture = None if slots is None else (self.routing_store, slots)

    def keep_routing_checksum(self) -> torch.Tensor:
        """Make every mixture-of-experts layer add a hash of its routing into one int64 scalar on the model's
        device, cumulative over forward passes (an engine under parallelism compares it across ranks)."""
        device = next(self.parameters()).device
        self.routing_checksum = torch.zeros((), dtype=torch.int64, device=device)
        for block in self.moe_blocks:
            block.routing_checksum = self.routing_checksum
        return self.routing_checksum

    def use_fused_kernels(self, small: bool = True) -> Qwen3ForCausalLM:
        """Run inference through fused Triton kernels (RMSNorm with the residual add, q/k norm with RoPE,
        SiLU-and-multiply) and fused projections (q, k and v in one matrix multiply, gate and up in another):
        the same maths in a dozen kernels per layer instead of dozens. Each layer's q/k/v weights (and gate/up)
        become views of one concatenated matrix, so loading a parameter by name still writes the matrix the
        fused path reads. For inference: no autograd, and no `.to()` afterwards (it would copy the views apart).
        A mixture-of-experts layer's experts run as grouped matrix multiplies (`tandem.kernels.moe`).
        An engine calls this as it loads the model onto a GPU, where attention runs through Triton kernels too:
        a shape those kernels cannot take is refused here (`check_kernel_shapes`), before any step. `small`: steps
        of few rows on one tensor-parallel rank through `tandem.kernels.small_linear` (`_forward_small`)."""
        self.check_kernel_shapes()
        from tandem.kernels import fused, moe, moe_routing

        self.fused = fused
        if small and self.tp.size == 1:  # (under TP a projection's output is all-reduced before the residual add)
            from tandem.kernels import small_linear

            self.small = small_linear
            self.small_arrived = small_linear.arrival_counts(next(self.parameters()).device)
        for block in self.moe_blocks:
            block.experts.kernel = moe.fused_experts
            block.route_kernel = moe_routing.route_topk
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_weight = _concatenate_as_views(attn.q_proj, attn.k_proj, attn.v_proj)
            if isinstance(mlp, Qwen3MLP):
                mlp.gate_up_weight = _concatenate_as_views(mlp.gate_proj, mlp.up_proj)
        return self

    def check_kernel_shapes(self) -> None:
        """Raise ValueError naming the config field if the inference kernels (`tandem.kernels`) cannot take this
        model's shape (this rank's heads under tensor parallelism)."""
        from tandem.kernels.limits import MAX_HIDDEN, attention_shape_error

        attn = self.model.layers[0].self_attn
        if error := attention_shape_error(attn.head_dim, attn.num_heads, attn.num_kv_heads):
            raise ValueError(f"model config: {error}")
        if self.config.hidden_size > MAX_HIDDEN:
            raise ValueError(f"model config: hidden_size must be at most {MAX_HIDDEN} for the GPU kernels, "
                             f"got {self.config.hidden_size}")

    def use_training_kernels(self) -> Qwen3ForCausalLM:
        """Train through fused Triton kernels that have backward passes (RMSNorm, RoPE, SiLU-and-multiply; see
        `tandem.kernels.training`): the same maths, a few kernels where PyTorch launches chains of them."""
        from tandem.kernels import training

        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = training.rmsnorm
            elif isinstance(module, Qwen3Attention):
                module.rope = training.apply_rope
            elif isinstance(module, Qwen3MLP | Qwen3Experts):
                module.silu_mul = training.silu_mul
        return self

    def compile_layers(self, backend: str = "inductor") -> Qwen3ForCausalLM:
        """Run each decoder layer's two regions around attention compiled (for training: inductor fuses the
        norms, RoPE and SiLU-and-multiply with their backward passes, and a layer's forward is three calls on the
        host instead of dozens). Attention stays eager: its context holds per-batch Python values (sequence
        lengths) that a compiled graph would have to guard on."""
        for layer in self.model.layers:
            layer.regions = compiled_regions(backend)
        return self

    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, ctx: AttentionContext):
        """Final hidden states [T, E] (after the last norm); `compute_logits` turns rows into logits."""
        if self.moe_blocks:
            self._set_capture(ctx)
        hidden = self._forward(input_ids_T, positions_T, ctx)
        if self.kv_sums is not None and (slots := ctx.token_slots()) is not None:
            self.kv_sums(slots)
        return hidden

    def _forward(self, input_ids_T, positions_T, ctx):
        if self.small is not None and input_ids_T.shape[0] <= self.small.MAX_ROWS:
            return self._forward_small(input_ids_T, positions_T, ctx)
        if self.fused is not None:
            return self._forward_fused(input_ids_T, positions_T, ctx)
        cos, sin = rope_cos_sin(positions_T, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(input_ids_T)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    def _forward_fused(self, input_ids_T, positions_T, ctx):
        """`forward` with the residual stream carried beside the hidden state, as fused kernels want it:
        each norm also adds the sublayer's output into the residual."""
        f, eps = self.fused, self.config.rms_norm_eps
        residual = self.model.embed_tokens(input_ids_T)
        layers = self.model.layers
        h = f.rmsnorm(residual, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            q, k, v = self._attention_qkv(attn, F.linear(h, attn.qkv_weight), positions_T, ctx)
            o = attn.o_proj(ctx.attend(attn.layer, q, k, v).reshape(h.shape[0], -1))
            h, residual = f.fused_add_rmsnorm(o, residual, layer.post_attention_layernorm.weight, eps)
            mlp = layer.mlp
            if isinstance(mlp, Qwen3SparseMoeBlock):
                out = mlp(h)
            else:
                gate, up = F.linear(h, mlp.gate_up_weight).chunk(2, dim=-1)
                out = mlp.down_proj(f.silu_mul(gate, up))
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, residual = f.fused_add_rmsnorm(out, residual, norm.weight, eps)
        return h

    def _attention_qkv(self, attn, qkv, positions_T, ctx):
        """The queries (normalised, rotated) and, where the context has no cache to take them directly, the keys
        and values, from one fused q/k/v projection's output."""
        f, T, D = self.fused, qkv.shape[0], attn.head_dim
        q, k, v = qkv.split([attn.num_heads * D, attn.num_kv_heads * D, attn.num_kv_heads * D], dim=-1)
        q, k, v = q.view(T, attn.num_heads, D), k.view(T, attn.num_kv_heads, D), v.view(T, attn.num_kv_heads, D)
        dest = ctx.kv_destination(attn.layer)  # the keys and values straight into the KV cache, if it has one
        if dest is not None and dest[0].dtype != q.dtype:
            dest = None  # (a cache of another dtype: `attend` converts them)
        q, k = f.qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, positions_T, self.config.rope_theta,
                              self.config.rms_norm_eps, kv_cache=None if dest is None else (v, *dest))
        return q, k, (v if dest is None else None)

    def _forward_small(self, input_ids_T, positions_T, ctx):
        """`forward` for a few rows (one tensor-parallel rank): each projection also normalises its input, adds its
        output into the residual stream or applies SiLU-and-multiply, and the q/k/v projection also q/k-normalises,
        rotates and writes keys and values into the KV cache (`tandem.kernels.small_linear`): four kernels and
        attention's a dense layer instead of ten. In a decode step of up to `FRESH_ROWS` rows whose attention takes
        them (`takes_fresh`), the q/k norm, RoPE and the KV write run in attention instead, and q/k/v is a plain
        projection."""
        f, eps = self.fused, self.config.rms_norm_eps
        s = functools.partial(self.small.small_linear, arrived=self.small_arrived)
        residual = self.model.embed_tokens(input_ids_T)  # a new tensor: the kernels add into it in place
        T = residual.shape[0]
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            dest = ctx.kv_destination(attn.layer)
            if T <= self.small.FRESH_ROWS and ctx.takes_fresh(residual.dtype, attn.head_dim):  # (in attention)
                D, H, K = attn.head_dim, attn.num_heads, attn.num_kv_heads
                qkv = s(residual, attn.qkv_weight, layer.input_layernorm.weight, eps)
                q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, K * D, K * D], -1))
                fresh = Fresh(k, v, attn.q_norm.weight, attn.k_norm.weight, positions_T, dest[2],
                              self.config.rope_theta, eps)
                o = ctx.attend_fresh(attn.layer, q, fresh).reshape(T, -1)
            elif dest is not None and dest[0].dtype == residual.dtype and self.small.takes_heads(attn.head_dim):
                q = self.small.small_qkv(residual, attn.qkv_weight, layer.input_layernorm.weight, eps,
                                         attn.q_norm.weight, attn.k_norm.weight, positions_T, self.config.rope_theta,
                                         attn.num_heads, dest, arrived=self.small_arrived)
                o = ctx.attend(attn.layer, q, None, None).reshape(T, -1)
            else:
                qkv = s(residual, attn.qkv_weight, layer.input_layernorm.weight, eps)
                o = ctx.attend(attn.layer, *self._attention_qkv(attn, qkv, positions_T, ctx)).reshape(T, -1)
            s(o, attn.o_proj.weight, out=residual)
            if isinstance(mlp, Qwen3SparseMoeBlock):
                residual += mlp(f.rmsnorm(residual, layer.post_attention_layernorm.weight, eps))
            else:
                act = s(residual, mlp.gate_up_weight, layer.post_attention_layernorm.weight, eps, silu=True)
                s(act, mlp.down_proj.weight, out=residual)
        return f.rmsnorm(residual, self.model.norm.weight, eps)

    def compute_logits(self, hidden_NE: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits [N, vocab] of the rows: fp32, or with `float32=False` in the weights' dtype, for a reader that
        converts them itself (the engine's sampler: bf16 converts to fp32 exactly, so it samples the same tokens,
        without the conversion's pass over the logits and with half their bytes; the fused sampler's logprobs
        agree with those of the fp32 logits to within fp32 rounding, not bit for bit)."""
        logits = self.lm_head(hidden_NE)
        return logits.float() if float32 else logits

    def init_random(self, seed: int, std: float = 0.02):
        """Hugging Face's initialisation (normal(0, std) for matrices, ones for norms), reproducible for a
        given seed and device type (drawn on the parameters' device, so an 8B model initialises in seconds).
        Each rank draws the full tensor and keeps its slice, so any TP and EP size holds the same model."""
        device = next(self.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        layout = layouts(self)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    dim, shape, group = layout[name]
                    full = torch.randn(shape, generator=gen, device=device, dtype=p.dtype) * std
                    dest, part = shard_into(p, full, dim, group)
                    dest.copy_(part)
        return self
