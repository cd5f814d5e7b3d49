"""The attention shapes the Triton kernels take. Importable without Triton: the model checks its shape against
these when it switches to the kernels (`Qwen3ForCausalLM.use_fused_kernels`), so a shape they cannot take is a
ValueError at load, and the kernels' own checks are internal invariants."""

from __future__ import annotations

MAX_HIDDEN = 16384  # a fused RMSNorm program holds a whole row in registers
MAX_HEAD_DIM = 256  # a head (padded to a power of two) is one block of registers
MAX_GROUP = 16  # query heads per kv head: a decode program packs a group into one dot's rows


def attention_shape_error(head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the attention kernels cannot take heads of this shape (naming the model config's field), or None.
    `num_heads`, `num_kv_heads`: the heads one rank holds (under tensor parallelism, its share)."""
    if head_dim % 2 or not 0 < head_dim <= MAX_HEAD_DIM:
        return f"head_dim must be even and at most {MAX_HEAD_DIM} for the GPU kernels, got {head_dim}"
    if num_heads % num_kv_heads or not 1 <= num_heads // num_kv_heads <= MAX_GROUP:
        return (f"num_attention_heads must be 1 to {MAX_GROUP} times num_key_value_heads for the GPU kernels, "
                f"got {num_heads} and {num_kv_heads}")
    return None


def head_block(head_dim: int) -> int:
    """The block an attention kernel loads a head into: the next power of two (`tl.arange` needs one), at least
    16 (`tl.dot`'s minimum); the lanes past head_dim are masked."""
    return max(16, 1 << (head_dim - 1).bit_length())


def takes_fresh(head_dim: int) -> bool:
    """Whether the decode attention kernel takes a step's keys and values before q/k norm and RoPE
    (`Fresh`) at this head dim: one its block holds unpadded (a head's lanes and its rotate-half pairs as they are)."""
    return head_block(head_dim) == head_dim
