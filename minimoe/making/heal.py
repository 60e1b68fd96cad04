"""Healing a split model: its next-token distribution distilled from the dense model it was split from.

    python -m minimoe.making.upcycle SmolLM2-135M-Instruct.Q4_1.gguf weights/smollm2-dense --experts 1 --top-k 1
    python -m minimoe.making.heal weights/smollm2-split weights/smollm2-split-healed --teacher weights/smollm2-dense \
        --tokens 300000 --stage routers --dtype bfloat16

The student is a split MoE (minimoe/making/split.py; its folder holds split.json). The teacher computes the
dense model's logits with the student's tokenizer: the one-expert copy above, or the default model
weights/smollm2-135m-moe (4 identical experts: the same logits for twice the MLP work). The loss, at
temperature 1 over the full vocabulary (T = tokens, V = vocab, p = softmax of the logits):

    KL(p_t || p_s) = 1/T sum_t sum_v p_t(v) (log p_t(v) - log p_s(v))

Stages (`--stage both` runs routers, then experts, each on `--tokens` tokens of fresh text):
- routers: each layer's router W_aff [E, D] and one output scale s_e per expert (init 1) on the
  expert's own group of down columns, the factor split.py's step 5 fitted: y = W_s a_s + s_e W_e a_e.
  The shared columns are not scaled, so the shared neurons still pass through whatever the router
  picks. The scales are folded into the down projections when written; no other weight changes.
- experts: the expert banks and the routers. A shared neuron's rows and column are one parameter
  copied into every expert; its gradient is the sum over the copies, given to each, so they stay equal.

Text (`--text`): `prose`, documents from the split's fitting files (CoQA stories and LAMBADA passages,
split.py FITTING_FILES) without the held-out fifth, so bench/split.py's held-out NLL stays unseen,
and without the documents the split fitted on (`unfitted_documents`); no SciQ or ARC text at all
(their test splits are what the frontier scores). Or `generated`: the teacher's own samples
(temperature 1, full vocabulary) continuing the first PROMPT_TOKENS tokens of those documents. The
first PROBE_ROWS rows are never trained on: the KL on them before and after each stage is recorded.

Deterministic for a seed on the CPU. `--dtype bfloat16` runs the teacher and the student's frozen
weights in bf16 (autocast), the trained parameters in fp32; the written model is fp32 either way and
its frozen weights are the student's own bits. The output folder is the student's files plus a
`healing` list in split.json: one record per run (teacher, text, tokens, settings, and per stage its
steps, learning rates, probe KL before and after, the loss curve), with the minimoe commit.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from minimoe.atomic import atomic_directory, check_replaceable
from minimoe.core.decoder.generate import generate
from minimoe.loading.checkpoint import RUN_DTYPES, from_pretrained, write_checkpoint
from minimoe.loading.config_json import read_config
from minimoe.loading.tokenizer import load_tokenizer
from minimoe.making.split import held_out, prose_documents, token_rows
from minimoe.runs.provenance import file_digest, git_commit

STAGES = {"routers": ("routers",), "experts": ("experts",), "both": ("routers", "experts")}
TEXTS = ("prose", "generated")
PROBE_ROWS = 4  # held-aside rows of the healing text: the KL before and after each stage
PROMPT_TOKENS = 8  # the start of a document that a generated row continues
GENERATE_ROWS = 16  # rows sampled at once


class HealError(ValueError):
    """The student or teacher cannot be healed or heal; the message names the folder and what was expected."""


@dataclass(frozen=True)
class HealSettings:
    tokens: int = 300_000  # training tokens per stage (whole rows of seq_len)
    stage: str = "routers"  # a key of STAGES
    text: str = "prose"  # one of TEXTS
    seq_len: int = 256
    batch_rows: int = 4  # rows per optimizer step
    router_lr: float = 1e-3  # Adam moves an entry by about lr per step; the fitted router's entries are ~0.03
    scale_lr: float = 1e-2  # the scales start at 1
    expert_lr: float = 3e-4  # the expert weights are ~0.2 (mean |w| of the split's banks)
    dtype: str = "float32"  # float32 or bfloat16 (teacher and frozen weights; trained parameters stay fp32)
    seed: int = 0  # text order, prompts and sampling


def kl_divergence(teacher_logits, student_logits):
    """KL(p_t || p_s) per token, averaged over tokens: logits [..., V], computed in fp32."""
    log_t, log_s = teacher_logits.float().log_softmax(-1), student_logits.float().log_softmax(-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean()


class OwnGroupScale(nn.Module):
    """A parametrization of a down bank [E, D, M]: expert e's own-group columns (after the N shared) times s_e."""

    def __init__(self, num_experts: int, shared: int):
        super().__init__()
        self.shared = shared
        self.scale = nn.Parameter(torch.ones(num_experts))  # [E], fp32 whatever the bank's dtype

    def forward(self, down):
        N = self.shared
        # back in the bank's dtype (a parametrization keeps it): the bf16 matmul rounds it so anyway
        return torch.cat([down[..., :N], (down[..., N:] * self.scale[:, None, None]).to(down.dtype)], dim=-1)


def tie_shared(experts, shared: int) -> None:
    """Gradient hooks that give every expert the sum of the shared neurons' gradients over experts."""
    M = experts.down_proj.weight.shape[-1]
    rows = torch.cat([torch.arange(shared), M + torch.arange(shared)])  # gate rows, then up rows

    def summed(grad, index, dim):
        total = grad.index_select(dim, index).sum(0, keepdim=True)
        return grad.index_copy(dim, index, total.expand_as(grad.index_select(dim, index)))
    experts.gate_up_proj.weight.register_hook(lambda g: summed(g, rows, 1))  # [E, 2M, D]
    experts.down_proj.weight.register_hook(lambda g: summed(g, torch.arange(shared), 2))  # [E, D, M]


def trained_names(model, stage: str) -> list[str]:
    names = [f"model.layers.{i}.mlp.gate.weight" for i in range(len(model.model.layers))]
    if stage == "experts":
        names += [f"model.layers.{i}.mlp.experts.{bank}.weight" for i in range(len(model.model.layers))
                  for bank in ("gate_up_proj", "down_proj")]
    return names


def check_pair(student: Path, teacher: Path) -> dict:
    """-> the student's split settings (split.json); raises HealError for a student that is no split or a teacher
    whose vocabulary differs (the KL compares distributions over the same tokens)."""
    if not (student / "split.json").is_file():
        raise HealError(f"{student}: no split.json; expected a split model (python -m minimoe.making.upcycle GGUF OUT "
                        f"--mode split), whose record says which down columns are shared")
    s, t = read_config(student), read_config(teacher)
    if s.vocab_size != t.vocab_size:
        raise HealError(f"teacher {teacher} has vocab_size {t.vocab_size}, the student {student} {s.vocab_size}; "
                        f"expected the dense model the split was made from (the same tokenizer)")
    if load_tokenizer(student).tokenizer.get_vocab() != load_tokenizer(teacher).tokenizer.get_vocab():
        raise HealError(f"teacher {teacher} and student {student} have tokenizers with different vocabularies; "
                        f"expected the dense model the split was made from (the same tokenizer)")
    return json.loads((student / "split.json").read_text())["settings"]


def unfitted_documents(tokenizer, split: dict) -> list[tuple[str, str]]:
    """The prose documents that the split neither held out nor fitted on. Its fit read the first documents
    of its seeded order up to fit_tokens (upcycle.py: split.token_rows with the split's seed); the repair
    fitted those tokens by least squares, so a probe on them would understate the split's error."""
    docs = [d for d in prose_documents() if not held_out(d[0])]
    target = split["fit_tokens"] // split["seq_len"] * split["seq_len"]
    fitted, n = set(), 0
    for i in torch.randperm(len(docs), generator=torch.Generator().manual_seed(split["seed"])).tolist():
        fitted.add(i)  # token_rows' loop: a document, its eos, then the check
        n += len(tokenizer.encode(docs[i][1])) + (tokenizer.eos_token_id is not None)
        if n >= target:
            break
    return [d for i, d in enumerate(docs) if i not in fitted]


def healing_text(text: str, tokenizer, teacher, docs, rows: int, seq_len: int, seed: int) -> torch.Tensor:
    """-> ids [rows, seq_len] from `docs` (id, text) in a seeded order, as they are or continued by the teacher."""
    if text == "prose":
        return token_rows(tokenizer.tokenizer, docs, rows * seq_len, seq_len, seed, tokenizer.eos_token_id)
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in torch.randperm(len(docs), generator=g).tolist():
        ids = tokenizer.encode(docs[i][1])
        if len(ids) >= PROMPT_TOKENS:
            prompts.append(ids[:PROMPT_TOKENS])
        if len(prompts) == rows:
            break
    if len(prompts) < rows:
        raise HealError(f"{len(prompts)} documents can start a generated row; {rows} rows were asked for")
    # eos_token_id None: a row runs to seq_len; what follows an eos is the teacher's own next text
    return torch.cat([generate(teacher, torch.tensor(prompts[i:i + GENERATE_ROWS]), seq_len - PROMPT_TOKENS,
                               temperature=1.0, generator=g) for i in range(0, rows, GENERATE_ROWS)])


def distil(student, teacher, ids, probe, stage: str, shared: int, s: HealSettings) -> tuple[dict, list]:
    """Train `stage`'s parameters of `student` on ids [R, L] in place -> (the stage's record, the scales [E]
    per layer, still to be folded; [] for experts). `student` keeps its OwnGroupScale parametrizations."""
    layers = [layer.mlp for layer in student.model.layers]
    for p in student.parameters():
        p.requires_grad_(False)
    routers = [mlp.gate.weight for mlp in layers]
    scales = []
    if stage == "routers":
        for mlp in layers:
            parametrize.register_parametrization(mlp.experts.down_proj, "weight",
                                                 OwnGroupScale(mlp.gate.weight.shape[0], shared))
            scales.append(mlp.experts.down_proj.parametrizations.weight[0].scale)
        groups = [{"params": routers, "lr": s.router_lr}, {"params": scales, "lr": s.scale_lr}]
    else:
        banks = [w.requires_grad_(True) for mlp in layers
                 for w in (mlp.experts.gate_up_proj.weight, mlp.experts.down_proj.weight)]
        for mlp in layers:
            tie_shared(mlp.experts, shared)
        groups = [{"params": routers, "lr": s.router_lr}, {"params": banks, "lr": s.expert_lr}]
    params = [p.requires_grad_(True) for g in groups for p in g["params"]]
    steps = ids.shape[0] // s.batch_rows
    warmup = max(1, steps // 10)
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: (i + 1) / warmup if i < warmup else
                                              0.5 * (1 + math.cos(math.pi * (i - warmup) / max(1, steps - warmup))))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.dtype == "bfloat16")

    def probe_kl():
        with torch.no_grad(), autocast:
            return kl_divergence(probe_logits, student(probe).logits).item()
    with torch.no_grad(), autocast:
        probe_logits = teacher(probe).logits.float()
    record, losses, t0 = {"stage": stage, "kl_before": probe_kl()}, [], time.perf_counter()
    for step, batch in enumerate(ids[:steps * s.batch_rows].split(s.batch_rows)):
        with autocast:
            with torch.no_grad():
                target = teacher(batch).logits
            loss = kl_divergence(target, student(batch).logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            done = (step + 1) * batch.numel()
            print(f"heal {stage}: step {step + 1}/{steps}, KL {loss.item():.4f}, "
                  f"{done / (time.perf_counter() - t0):.0f} tokens/s", flush=True)
    tenth = max(1, steps // 10)
    record.update(kl_after=probe_kl(), steps=steps, tokens=steps * s.batch_rows * ids.shape[1],
                  lr={g: getattr(s, f"{g}_lr") for g in (("router", "scale") if scales else ("router", "expert"))},
                  curve=[round(sum(losses[i:i + tenth]) / len(losses[i:i + tenth]), 4) for i in range(0, steps, tenth)],
                  seconds=round(time.perf_counter() - t0, 1))
    if scales:
        flat = torch.stack(scales).detach()
        record["scales"] = {"min": round(flat.min().item(), 4), "max": round(flat.max().item(), 4)}
    return record, [p.detach().clone() for p in scales]


def heal(student, out, teacher, s: HealSettings = HealSettings()) -> dict:
    """Distil `teacher` into the split model in folder `student`, write the result to `out` -> its healing record."""
    if s.stage not in STAGES or s.text not in TEXTS or s.dtype not in RUN_DTYPES:
        raise HealError(f"stage {s.stage!r}, text {s.text!r}, dtype {s.dtype!r}; expected a stage in {list(STAGES)}, "
                        f"a text in {TEXTS} and {' or '.join(RUN_DTYPES)}")
    student, out, teacher_dir = Path(student), Path(out), Path(teacher)
    check_replaceable(out, "model")  # before the work
    split_settings = check_pair(student, teacher_dir)
    shared = split_settings["shared"]
    stages = STAGES[s.stage]
    rows = s.tokens // s.seq_len
    if rows < s.batch_rows:
        raise HealError(f"tokens {s.tokens} make {rows} rows of seq_len {s.seq_len}; expected at least "
                        f"batch_rows {s.batch_rows}")
    dtype = getattr(torch, s.dtype)
    final = from_pretrained(student, dtype=torch.float32)  # the written model: its frozen weights stay bit-exact
    work = final if dtype == torch.float32 else from_pretrained(student, dtype=dtype)
    teach = from_pretrained(teacher_dir, dtype=dtype)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(student)
    ids = healing_text(s.text, tokenizer, teach, unfitted_documents(tokenizer, split_settings),
                       PROBE_ROWS + rows * len(stages), s.seq_len, s.seed)
    records = []
    for k, stage in enumerate(stages):
        for name in trained_names(final, stage) if work is not final else []:  # train final's fp32 tensors
            module, _, leaf = name.rpartition(".")
            work.get_submodule(module)._parameters[leaf] = final.get_parameter(name)
        block = ids[PROBE_ROWS + k * rows:PROBE_ROWS + (k + 1) * rows]
        record, scales = distil(work, teach, block, ids[:PROBE_ROWS], stage, shared, s)
        records.append(record)
        for i, scale in enumerate(scales):  # fold s_e into final's own-group columns, in fp32
            parametrize.remove_parametrizations(work.model.layers[i].mlp.experts.down_proj, "weight",
                                                leave_parametrized=False)
            with torch.no_grad():
                final.model.layers[i].mlp.experts.down_proj.weight[..., shared:] *= scale[:, None, None]
    for p in final.parameters():
        p.requires_grad_(False)
    split = json.loads((student / "split.json").read_text())
    record = {"teacher": {"path": str(teacher), "num_experts": teach.config.num_experts,
                          "sha256": {f.name: file_digest(f) for f in sorted(teacher_dir.glob("*.safetensors"))}},
              "text": s.text, "settings": asdict(s), "probe_rows": PROBE_ROWS, "stages": records,
              "seconds": round(time.perf_counter() - t0, 1), "minimoe_git": git_commit()}
    split["healing"] = split.get("healing", []) + [record]
    with atomic_directory(out, "model") as tmp:
        write_checkpoint(final, tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (student / name).is_file():
                shutil.copyfile(student / name, tmp / name)
        (tmp / "split.json").write_text(json.dumps(split, indent=1) + "\n")
    return record


if __name__ == "__main__":  # python -m minimoe.making.heal runs its command, minimoe/cli/heal_split.py
    import runpy
    runpy.run_module("minimoe.cli.heal_split", run_name="__main__")
