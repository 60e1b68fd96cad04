"""ESFT, expert-specialized fine-tuning ("Let the Expert Stick to His Last: Expert-Specialized Fine-Tuning
for Sparse Architectural Large Language Models", DeepSeek, 2024): per MoE layer, the experts most used on
the task's training data train, and nothing else does.

    gate  (average gate score):     share_e = sum_t g_{t,e} / sum_t sum_j g_{t,j}    (g: the family's combine
                                     weight of e for token t, 0 where e is not among its K)
    token (token-selection ratio):  share_e = #{t : e in S_t} / (K * #tokens)
    chosen = the fewest experts, in decreasing share, whose shares sum to >= p

over the real tokens (attention mask) of every training example, prompt and candidates, with the base
model (`usage`, `select`). Defaults: token selection at p = 0.2, the public release's settings.

Routing is native (`ESFTRouter`), the gate frozen; the router holds the choice as a buffer `chosen` [E]
(so an adapter, a checkpoint and a resume carry it), filled once before training's first step
(`Method.prepare`, from the data; training.py). What trains (`restrict`, `Method.install`): the LoRA of
the expert banks of the layers in scope, each expert's rows masked to zero gradient unless it is chosen
(a hook on lora_A [E, r, in] and lora_B [E, out, r], which the optimizer then never moves: B stays 0
and A's decay changes nothing); every other LoRA is frozen. This is the paper's selection with LoRA on
the chosen experts (the "LoRA form", the default and the sweep row's).

The paper's "full form" (esft_form="full"): the chosen experts' weights train in full and no LoRA does.
Their rows of each bank are the router's parameters `rows` [k, out, in] (`take_rows`, once the choice is
made), so the optimizer's state is theirs alone and the bank is never copied or given a gradient: a
forward hook on each bank (`attach`) recomputes the chosen experts' row blocks with them. Being router
state, they travel in the adapter (`fit` sizes them before a load's strict copy); `merged_banks` puts them
into the banks for the merged export.

Choices where the paper (written for DeepSeek-V2's softmax router) is silent: shares are per layer
(the release's script normalises the summed scores; here each layer's sum to 1); on sigmoid scorers
(DeepSeek-V3) g is the combine weight, correction bias never in it and scaling cancelling in the share;
with K = 1 and renormalisation (g = 1) the two criteria coincide.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minimoe.core.routing_methods.routing import NativeRouter, Routing, Scoring, moe_blocks

CRITERIA = ("token", "gate")
FORMS = ("lora", "full")
BANKS = ("gate_up_proj", "up_proj", "down_proj")  # a bank's name, whichever its experts have (`banks`)


def banks(experts) -> list[str]:
    """The expert banks of an experts module: SwiGLU's gate_up_proj and down_proj, squared ReLU's up_proj and down_proj."""
    return [bank for bank in BANKS if hasattr(experts, bank)]


def usage(routings, attention_mask) -> dict[int, torch.Tensor]:
    """One forward's per-layer sums over its real tokens -> {layer: [2, E] fp64 (gate sums, selection counts)}.
    routings: the model output's list (None: a dense layer); attention_mask [B, T] (None: every token)."""
    out = {}
    for i, r in enumerate(routings):
        if r is None:
            continue
        T, E = r.logits.shape
        real = torch.ones(T, dtype=torch.float64) if attention_mask is None else attention_mask.reshape(-1).double()
        real = real.to(r.logits.device)[:, None].expand_as(r.experts).reshape(-1)  # [T*K]
        flat = r.experts.reshape(-1)
        gate = torch.zeros(E, dtype=torch.float64, device=flat.device).index_add_(
            0, flat, r.weights.detach().double().reshape(-1) * real)
        count = torch.zeros(E, dtype=torch.float64, device=flat.device).index_add_(0, flat, real)
        out[i] = torch.stack([gate, count])
    return out


def select(sums: torch.Tensor, criterion: str, p: float) -> torch.Tensor:
    """sums [2, E] (`usage`, summed over the data) -> chosen [E] bool: the fewest experts, in decreasing
    share (ties: the lower index first), whose shares reach p."""
    score = sums[0 if criterion == "gate" else 1]
    share = score / score.sum()
    order = sorted(range(share.numel()), key=lambda e: (-share[e].item(), e))
    chosen, total = torch.zeros(share.numel(), dtype=torch.bool), 0.0
    for e in order:
        if total >= p:
            break
        chosen[e] = True
        total += share[e].item()
    return chosen


class ESFTRouter(NativeRouter):
    """Native routing; `chosen` [E] bool, the experts that train (set by `prepare`, kept by the adapter)."""

    def __init__(self, scoring: Scoring, num_experts: int, esft_criterion: str, esft_p: float, esft_form: str = "lora",
                 device=None):
        if esft_form not in FORMS:
            raise ValueError(f"esft: esft_form={esft_form!r}; expected one of {FORMS}")
        if esft_criterion not in CRITERIA:
            raise ValueError(f"esft: esft_criterion={esft_criterion!r}; expected one of {CRITERIA}")
        if not (isinstance(esft_p, (int, float)) and not isinstance(esft_p, bool) and 0 < esft_p <= 1):
            raise ValueError(f"esft: esft_p={esft_p!r}; expected a cumulative share in (0, 1]")
        super().__init__(scoring)
        self.criterion, self.p = esft_criterion, float(esft_p)
        self.register_buffer("chosen", torch.zeros(num_experts, dtype=torch.bool, device=device))
        self.form = esft_form
        # the full form's trained weights: bank -> the chosen experts' rows [k, out, in] (fp32, as adapters
        # are), in expert order; empty until the choice is made (`take_rows`), and always in the LoRA form
        self.rows = nn.ParameterDict()
        self.index: list[int] = []  # the chosen experts, on the host: the forward reads no device value for it

    @classmethod
    def from_gate(cls, gate, config, **options):
        return cls(Scoring.of(config), gate.weight.shape[0], device=gate.weight.device, **options)

    def forward(self, x, logits, experts=None, correction=None):
        experts, weights = self.scoring.select(logits, experts, correction)
        return Routing(logits=logits, experts=experts, weights=weights)

    def take_rows(self, mlp):
        """Full form: the chosen experts' rows of each bank become this router's trainable `rows` (a
        k-row copy, once), and the banks' forward uses them (`attach`). The LoRA form: nothing."""
        if self.form != "full":
            return
        self.index = torch.nonzero(self.chosen).flatten().tolist()
        for bank in banks(mlp.experts):
            weight = getattr(mlp.experts, bank).weight.detach()
            self.rows[bank] = nn.Parameter(weight[self.index].float())
        attach(mlp)

    def fit(self, mlp, state: dict):
        """Before an adapter's tensors are copied in (runs/adapters.py): size `rows` by its saved choice."""
        if self.form == "full" and "chosen" in state:
            with torch.no_grad():
                self.chosen.copy_(state["chosen"])
            self.take_rows(mlp)

    def merged_banks(self, mlp) -> dict:
        """Full form: bank -> its weight with the trained rows in place (a copy; export_merged's)."""
        out = {}
        for bank, rows in self.rows.items():
            weight = getattr(mlp.experts, bank).weight.detach().clone()
            weight[self.index] = rows.detach().to(weight.dtype)
            out[bank] = weight
        return out


def attach(mlp):
    """A forward hook on each expert bank of `mlp`, once: the chosen experts' row blocks are computed with
    the router's `rows` instead of the frozen bank's (whose frozen LoRA adds exact zeros); the bank itself is
    never copied or written. The router is read at call time: loading an adapter installs a new one."""
    for bank in banks(mlp.experts):
        module = getattr(mlp.experts, bank)
        if not getattr(module, "esft_attached", False):
            module.register_forward_hook(lambda m, args, y, mlp=mlp, bank=bank: chosen_rows(mlp.router, bank, *args, y))
            module.esft_attached = True


def chosen_rows(router, bank: str, x, dispatch, y):
    """x [N, in] sorted by expert, y [N, out] the frozen bank's output -> y with each chosen expert's block
    x_e @ rows_j^T. One host read of the block sizes, as experts.py's loop path (dispatch.counts_list)."""
    rows = router.rows[bank] if isinstance(router, ESFTRouter) and bank in router.rows else None
    if rows is None:
        return y
    slot = {e: j for j, e in enumerate(router.index)}
    xs, ys = x.split(dispatch.counts_list), y.split(dispatch.counts_list)
    return torch.cat([xs[e] @ rows[slot[e]].T.to(x.dtype) if e in slot else ys[e] for e in range(len(ys))])


def esft_layers(model) -> dict:
    """Layer index -> MoE block, for the layers whose router is ESFT's."""
    return {i: mlp for i, mlp in moe_blocks(model).items() if isinstance(mlp.router, ESFTRouter)}


def prepare(model, forwards):
    """Fill each ESFT layer's `chosen` from the training data: `forwards` yields (routings, attention_mask)
    of the base model's forward over each batch of it (training.py); under torchrun, summed over ranks."""
    sums = {}
    for routings, mask in forwards:
        for i, s in usage(routings, mask).items():
            sums[i] = sums.get(i, 0) + s
    for i, s in sorted(sums.items()):
        if dist.is_initialized():
            dist.all_reduce(s)
    for i, mlp in esft_layers(model).items():
        mlp.router.chosen.copy_(select(sums[i].cpu(), mlp.router.criterion, mlp.router.p))
        mlp.router.take_rows(mlp)


def restrict(model):
    """Only the chosen experts train: every LoRA but the expert banks' in ESFT layers frozen, and those
    banks' gradients masked to the chosen experts' rows (read at backward time: a resumed run's buffer).
    The full form: no LoRA trains; the chosen rows do (`ESFTRouter.take_rows`)."""
    layers = esft_layers(model)
    full = any(mlp.router.form == "full" for mlp in layers.values())
    for name, p in model.named_parameters():
        if not p.requires_grad or not name.endswith((".lora_A", ".lora_B")):
            continue
        parts = name.split(".")  # model.layers.<i>.mlp.experts.<bank>.lora_X
        i = int(parts[2])
        if i in layers and parts[3:5] == ["mlp", "experts"] and not full:  # the block's router as it is at backward time:
            # loading a checkpoint (a resume) installs new router modules, the choice in their buffer
            p.register_hook(lambda g, mlp=layers[i]: g * mlp.router.chosen.to(g.dtype).view(-1, *[1] * (g.dim() - 1)))
        else:
            p.requires_grad_(False)
