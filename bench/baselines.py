"""The baselines' training cost: one step's time relative to CE, one MoE layer at a real family's widths.

    python bench/baselines.py                        # CPU, Granite-3.1-3B-A800M's widths, 1 layer
    python bench/baselines.py --family olmoe --tokens 256
    python bench/baselines.py --smoke                # tiny widths: the script itself (tests/test_bench.py)

Each candidate is train.py's install (training.install_method: the recipe's LoRA on q, k, v and the
experts, then the method on the layer) and one forward + backward + AdamW step of next-token CE on a
fixed random batch; CE + load balancing adds transformers' loss at the family's coefficient. Each
candidate's rounds are interleaved with CE's (common.interleaved; two models alive at a time), so a
loaded machine slows both alike: the ratios are the figure, not the seconds. bench/gpu.py's `baselines` stage runs `measure` on the GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from minimoe.core.routing_methods.esft import esft_layers  # noqa: E402
from minimoe.core.routing_methods.methods import Method  # noqa: E402
from minimoe.core.decoder.model import MoEConfig, MoEForCausalLM, init_weights  # noqa: E402
from minimoe.core.routing_methods.objectives import load_balancing_loss  # noqa: E402
from minimoe.runs.training import install_method  # noqa: E402

# candidate -> (method, tune_router, with the load-balancing loss, LoRA targets, method options): as the sweep's
# rows train; ESFT's full form (no sweep row) beside its LoRA form
RECIPE = ("q", "k", "v", "experts")
CANDIDATES = {"CE": ("native", False, False, RECIPE, {}), "CE + affinity tuning": ("native", True, False, RECIPE, {}),
              "DenseMixer": ("densemixer", False, False, RECIPE, {}), "Router only": ("router", False, False, RECIPE, {}),
              "CE + load balancing": ("native", False, True, RECIPE, {}),
              "ESFT": ("esft", False, False, ("experts",), {}),
              "ESFT (full form)": ("esft", False, False, ("experts",), {"esft_form": "full"})}
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
             num_experts=8, num_experts_per_tok=2)


def step_fn(config: MoEConfig, method: str, tune_router: bool, aux: bool, targets, options: dict, ids, device):
    """One training step of a fresh model with `method` installed on its MoE layers -> a callable."""
    model = init_weights(MoEForCausalLM(config), generator=torch.Generator().manual_seed(0)).to(device).train()
    cuda = device.type == "cuda"
    if cuda:  # the GPU recipe: a bf16 base under autocast, fp32 LoRA and tuned gates (install_method)
        model.to(torch.bfloat16)
    configured = Method.from_record({"name": method, "tune_router": tune_router, "options": options, "layers": "all"})
    cfg = SimpleNamespace(lora_rank=8, lora_alpha=8, lora_dropout=0.0, lora_dtype="float32", lora_targets=list(targets),
                          method=configured)
    install_method(model, cfg)
    for mlp in esft_layers(model).values():  # ESFT: a quarter of the experts chosen (training.py chooses from data)
        mlp.router.chosen[::4] = True
        mlp.router.take_rows(mlp)  # the full form's trainable rows (esft.prepare's step after the choice)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    def step():
        with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
            out = model(ids)
            loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            if aux:
                loss = loss + config.router_aux_loss_coef * load_balancing_loss(out.routings)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
    moving = sum(p.numel() for p in params)  # the parameters that train; ESFT's unchosen experts' rows do not
    for mlp in esft_layers(model).values():
        moving -= sum(p[0].numel() for p in mlp.experts.parameters() if p.requires_grad) * int((~mlp.router.chosen).sum())
    return step, moving


def measure(family: str, device, *, tokens: int = 256, rounds: int = 5, smoke: bool = False) -> list[dict]:
    """Each candidate's step time over CE's (median over interleaved rounds [min-max]) and its trained parameters."""
    # The layer at the official widths; the vocabulary cut to 4096 (the LM head is no part of the layer's cost).
    shape = {**common.OFFICIAL[family], "num_hidden_layers": 1, "vocab_size": 4096, **(SMOKE if smoke else {})}
    config = MoEConfig(**shape)
    ids = torch.randint(0, config.vocab_size, (2, tokens // 2), generator=torch.Generator().manual_seed(1)).to(device)
    ce, ce_count = step_fn(config, *CANDIDATES["CE"], ids, device)
    rows = [dict(candidate="CE", model=f"{family} 1L", ratio=1.0, low=1.0, high=1.0, trained=ce_count)]
    for name, candidate in list(CANDIDATES.items())[1:]:  # two models alive at a time: CE and this one
        step, count = step_fn(config, *candidate, ids, device)
        timing = common.interleaved({name: step, "CE": ce}, rounds)
        ratio, low, high = timing.ratio(name, "CE")
        rows.append(dict(candidate=name, model=f"{family} 1L", ratio=ratio, low=low, high=high, trained=count,
                         seconds=timing.median(name), ce_seconds=timing.median("CE")))
        del step
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="granitemoe", choices=list(common.OFFICIAL))
    p.add_argument("--tokens", type=int, default=256, help="tokens a step (two rows)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--smoke", action="store_true", help="tiny widths, two rounds")
    args = p.parse_args(argv)
    rows = measure(args.family, torch.device(args.device), tokens=args.tokens, rounds=2 if args.smoke else args.rounds,
                   smoke=args.smoke)
    lines = [f"{args.tokens} tokens a step, {args.device}, {torch.get_num_threads()} threads; step time over CE's, "
             "median of interleaved rounds [min-max]", "",
             "| candidate | model | step s (median): it / CE beside it | / CE | trained parameters |", "|---|---|---|---|---|"]
    lines += [f"| {r['candidate']} | {r['model']} | {r.get('seconds', 0):.3f} / {r.get('ce_seconds', 0):.3f} | "
              f"{r['ratio']:.2f}x [{r['low']:.2f}-{r['high']:.2f}] | {r['trained']:,} |" for r in rows]
    common.write_report("\n".join(lines), "baselines" + ("-smoke" if args.smoke else ""))
    return rows


if __name__ == "__main__":
    main()
