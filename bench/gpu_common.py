"""What every stage of bench/gpu.py shares: the table's rows (`row`, streamed to the JSONL as they are made), the
time limit (`Budget`, `Stopped`), timing on the device (`timed`) and its host syncs (`syncs`), and the models the
stages time: a family at its published widths or at the smoke run's (`config`), random weights drawn on the device
(`random_model`), the active parameters MFU counts (`active_params`)."""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch

from bench import common
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, init_weights
from minimoe.loading.config_json import config_from_dict


ROWS: list[dict] = []


STREAM: list[Path] = []  # the JSONL that every row is appended to as it is made (main sets it)


SMOKE_WIDTHS = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                    num_experts=8, num_experts_per_tok=2)


# The published widths that SMOKE_WIDTHS leaves wide, cut for the CPU (head_dim: hidden / heads, as above).
SMOKE_EXTRA = dict(head_dim=16, dense_intermediate_size=48, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, shared_expert_intermediate_size=40,
                   # the hybrids' mixers (Mamba-2's head width follows: 2 x 64 / 8; chunks shorter than the rows)
                   mamba_n_heads=8, mamba_d_head="auto", mamba_d_state=16, mamba_chunk_size=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                   # the 2026 families': the DSA indexer, MLA's q low rank, Gemma 4's global layers
                   index_n_heads=4, index_head_dim=16, index_topk=16, q_lora_rank=32, global_head_dim=32,
                   num_global_key_value_heads=1)


def row(section, model, metric, minimoe=None, reference=None, ratio=None, note=""):
    note = " ".join(str(note).split())  # an error's lines would break the table's row
    ROWS.append(dict(section=section, model=model, metric=metric, minimoe=minimoe, reference=reference,
                     ratio=ratio, note=note))
    for path in STREAM:
        with open(path, "a") as f:
            f.write(json.dumps(ROWS[-1], default=str) + "\n")


class Stopped(Exception):
    """SIGTERM (a time limit outside the script): the table is written with what was measured."""


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def config(family: str, layers: int, smoke: bool) -> MoEConfig:
    if family in common.OFFICIAL_NEW:  # config.json's names, read through the family's record
        d = common.OFFICIAL_NEW[family]
        kinds = {"layer_types": d["layer_types"][:layers]} if "layer_types" in d else {}  # a hybrid's first layers
        c = config_from_dict({**d, "num_hidden_layers": layers, **kinds})
        if not smoke:
            return c
        mla = {"num_key_value_heads": SMOKE_WIDTHS["num_attention_heads"]} if "mla" in c.mixers else {}  # one kv head each
        if c.mixer_types:  # a hybrid's few smoke layers: each of its mixers once, in the order the full depth has them
            every = list(dict.fromkeys(config_from_dict(dict(d)).mixer_types))
            mla["mixer_types"] = (every * layers)[:layers]
        flat = c.flat()  # the mixers' options by their flat names, as SMOKE_EXTRA's
        if flat.get("n_group", 1) > 1:  # expert groups of two at the smoke run's 8 experts (DeepSeek-V3.2's 8 groups)
            mla.update(n_group=4, topk_group=2)
        return MoEConfig.from_flat({**flat, **SMOKE_WIDTHS, **mla, **{k: v for k, v in SMOKE_EXTRA.items() if flat.get(k)},
                                    "extra": c.extra})
    d = dict(common.OFFICIAL[family], num_hidden_layers=layers)
    if smoke:
        d.update(SMOKE_WIDTHS)
    return MoEConfig(**d)


def active_params(c: MoEConfig) -> int:
    """N: parameters a token passes through: every weight but the embedding, the routed experts' banks
    counted K / E (attention, norms, routers, shared experts, dense layers and the LM head whole, tied or not)."""
    with torch.device("meta"):
        model = MoEForCausalLM(c)
    share = c.num_experts_per_tok / c.num_experts
    return round(sum(p.numel() * (share if ".mlp.experts." in name else 1)
                     for name, p in model.named_parameters(remove_duplicate=False) if "embed_tokens" not in name))


def random_model(c: MoEConfig, device) -> MoEForCausalLM:
    """Random bf16 weights of config c, drawn on the device (a CPU init of a 3B model takes minutes)."""
    with torch.device(device):
        model = MoEForCausalLM(c).to(torch.bfloat16)
    return init_weights(model, generator=torch.Generator(device).manual_seed(0))


def syncs(step, device, name, metric="host syncs in one LoRA step"):
    """Host syncs in one step: the dispatcher's view (HostSyncs, any device) and, on CUDA, torch's own
    sync debug mode (which also sees copies to the host)."""
    with common.HostSyncs(device.type if device.type != "cpu" else None) as seen:
        step()
    cuda_syncs = "-"
    if device.type == "cuda":
        sync(device)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
            cuda_syncs = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    row("syncs", name, f"{metric} (dispatcher ops / CUDA sync debug mode)", f"{seen.total} / {cuda_syncs}",
        note=json.dumps(seen.counts) if seen.counts else "")
