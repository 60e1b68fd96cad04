"""Rotary position embeddings: the frequencies of each `rope_scaling` type, and the two pair layouts.

`rope_frequencies` reads a config.json's `rope_scaling` as transformers 4.57's ROPE_INIT_FUNCTIONS
do (modeling_rope_utils.py) and returns the inverse frequencies [d/2] and the attention factor
that multiplies cos and sin. `rope_cos_sin` builds cos, sin [B, T, d] in fp32 (cast at the end),
for the rotate-half convention every family here uses: pair i is (x[i], x[i + d/2]).

Decisions:
- Types: none/"default", "linear", "yarn" and "llama3", the ones the families' published configs use
  (DeepSeek-V2-Lite: yarn, factor 40, mscale = mscale_all_dim = 0.707; gpt-oss-20b: yarn, factor 32,
  truncate false; Moonlight: none; Llama-4-Scout: llama3, factor 16, low = high freq factor 1). Any other type is refused by name rather than run wrong.
  "dynamic" and "longrope" depend on the sequence length at run time; none of our families uses them.
- YaRN (Peng et al. 2023): each frequency is interpolated (divided by `factor`) or kept, with a
  linear ramp between the dimensions that turn `beta_fast` and `beta_slow` times over the original
  context; cos and sin are scaled by `attention_factor`, by default 0.1 ln(factor) + 1, or, with
  `mscale` and `mscale_all_dim`, the ratio mscale(factor, mscale) / mscale(factor, mscale_all_dim).
- Multi-head Latent Attention also multiplies its softmax scale by mscale(factor, mscale_all_dim)^2
  (DeepSeek's own modeling_deepseek.py): `yarn_softmax_mscale`. transformers 4.57 applies it in
  DeepSeek-V3 but not in DeepSeek-V2 (fixed upstream later: transformers PR 47435); we apply it
  in both, as DeepSeek's code does (docs/families.md).
- Per layer type (Gemma 4's `rope_parameters`, one rope per layer type: `layer_type_frequencies`): "default" over
  the layer's whole head, or "proportional" (p-RoPE): the first partial_rotary_factor of the head's frequency pairs
  turn at theta^(-2i/d), d the whole head's width, the others not at all (frequency 0: cos 1, sin 0, the dims
  pass unchanged, exactly), over the whole head in rotate-half's pairs (x[i], x[i + d/2]); GLM's partial rotary
  instead rotates the first dims only, its pairs (x[i], x[i + r/2]). A "default" entry turns the whole head in
  Gemma 4 whatever partial_rotary_factor it holds; in MiMo-V2-Flash it turns the first r = int(d * factor) dims, GLM's
  way, with the factor 0.334 where the entry gives none (`partial`: its modeling file's compute_default_rope_parameters).
- DeepSeek-V4 turns the *last* r dims of each head as interleaved pairs, in place (`rotate_trailing_pairs`): its
  values are its keys, so the attention output carries the rotation, undone by the opposite turn (-sin).
- DeepSeek stores its rope dims as interleaved pairs (x[2i], x[2i+1]). `deinterleave` reorders
  them to rotate-half's (evens, then odds), as transformers' `rope_interleave` does; applied to both
  q and k it leaves every q.k dot product, hence attention, unchanged.
"""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def rope_type(rope_scaling: dict | None) -> str:
    if rope_scaling is None:
        return "default"
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"config: rope_scaling type {kind!r} is not supported; expected one of {ROPE_TYPES} or null")
    return kind


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(head_dim: int, theta: float, rope_scaling: dict | None,
                     max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """-> inverse frequencies [head_dim/2] (fp32) and the factor that multiplies cos and sin."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    wavelength = theta ** exponent  # [d/2] (over 2 pi)
    inv_freq = 1.0 / wavelength
    kind = rope_type(rope_scaling)
    if kind == "default":
        return inv_freq, 1.0
    factor = float(rope_scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return llama3_frequencies(inv_freq, factor, rope_scaling), 1.0
    # yarn
    s = rope_scaling
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, s["mscale"]) / yarn_mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = yarn_mscale(factor)
    original = s.get("original_max_position_embeddings") or max_position_embeddings
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_turning(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [d/2]
    keep = 1 - ramp  # 1: high frequency, kept (extrapolated); 0: low frequency, interpolated
    inv_freq = 1.0 / (factor * wavelength) * (1 - keep) + inv_freq * keep
    return inv_freq, float(attention_factor)


def llama3_frequencies(inv_freq, factor: float, s: dict):
    """Llama 3.1's rope: wavelengths beyond the original context over low_freq_factor are divided by
    `factor`, those below it over high_freq_factor kept, the ones between interpolated smoothly. With
    low = high freq factor (Llama-4-Scout) nothing lies between: the smoothing's 0/0 is never selected."""
    low, high, original = s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq  # [d/2]
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    between = ~(wavelength < original / high) & ~(wavelength > original / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


LAYER_ROPE_TYPES = ("default", "proportional")  # a layer type's rope_type (Gemma 4's rope_parameters)


def layer_type_frequencies(rope: dict, head_dim: int, partial: float | None = None) -> torch.Tensor:
    """One layer type's rope (its rope_parameters entry) over heads of `head_dim` -> inverse frequencies [d/2], or
    [r/2] for a "default" entry turning r dims (`partial` set: module docstring); a type we do not compute is refused
    by name."""
    kind = rope.get("rope_type", "default")
    if kind not in LAYER_ROPE_TYPES:
        raise ValueError(f"config: rope_parameters rope_type {kind!r} is not supported per layer type; expected one "
                         f"of {LAYER_ROPE_TYPES}")
    if not isinstance(rope.get("rope_theta"), (int, float)):
        raise ValueError(f"config: rope_parameters {rope!r} of a layer type has no rope_theta; expected a number")
    if kind == "default":
        r = head_dim if partial is None else int(head_dim * rope.get("partial_rotary_factor", partial))
        return rope_frequencies(r, rope["rope_theta"], None, 0)[0]  # [r/2]
    inv_freq, _ = rope_frequencies(head_dim, rope["rope_theta"], None, 0)  # [d/2]
    turning = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)  # pairs that turn
    inv_freq = torch.cat([inv_freq[:turning], inv_freq.new_zeros(head_dim // 2 - turning)])
    return inv_freq / rope.get("factor", 1.0)


def layer_rope_dim(rope: dict, head_dim: int, partial: float | None = None) -> int:
    """The dims a layer type's rope turns in each head: its frequencies' (an odd r turns r + 1, as transformers)."""
    return 2 * layer_type_frequencies(rope, head_dim, partial).numel()


def yarn_softmax_mscale(rope_scaling: dict | None) -> float:
    """What MLA multiplies its softmax scale by: mscale(factor, mscale_all_dim)^2, else 1."""
    if rope_type(rope_scaling) == "default" or not rope_scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(float(rope_scaling["factor"]), rope_scaling["mscale_all_dim"]) ** 2


def rope_cos_sin(position_ids, inv_freq, attention_factor: float, dtype):
    """position_ids [B, T] -> cos, sin [B, T, d] (d = 2 len(inv_freq)), computed in fp32, then cast."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)  # [B, T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def apply_rope(x, cos, sin):  # x [B, h, T, d], cos/sin [B, T, d]: rotate-half's pairs (x[i], x[i + d/2])
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotate_trailing_pairs(x, cos, sin):
    """DeepSeek-V4's rope: the last r dims of x [..., d] as interleaved pairs (x[2i], x[2i+1]), turned by cos, sin
    [..., r/2] (broadcast over x's other leading dims) in fp32 and cast back once; the first d - r dims pass."""
    r = 2 * cos.shape[-1]
    rot = x[..., -r:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], rot.to(x.dtype)), dim=-1)


def deinterleave(x):
    """x [..., d] with pairs (x[2i], x[2i+1]) -> [..., d] with the evens first, then the odds."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def query_temperature(inputs, B: int, T: int, floor_scale: float, beta: float, shift: float, device):
    """Llama 4's position-dependent query scale, [B, 1, T, 1] fp32: 1 + beta * log(1 + floor((p + shift) / floor_scale))
    at each query's position p (each packed candidate's own, else cache_start onwards). Llama 4's NoPE layers shift
    by 1 (floor_scale 8192); Mistral 4's MLA by 0 (floor_scale: YaRN's original_max_position_embeddings)."""
    if inputs.segment_ids is not None:
        p = inputs.position_ids.float()  # [B, T]
    else:
        p = torch.arange(inputs.cache_start, inputs.cache_start + T, device=device).float().expand(B, T)
    return (torch.log1p(torch.floor((p + shift) / floor_scale)) * beta + 1.0)[:, None, :, None]
