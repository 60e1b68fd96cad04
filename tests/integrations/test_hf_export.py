"""Tests for minimoe.integrations.hf_export: peft + transformers (the test-only oracle) load an exported adapter with our logits."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_model, transformers_major
from minimoe.cli.export import main
from minimoe.core.adaptation.lora import LoRAGroupedLinear, add_lora
from minimoe.core.decoder.family_record import FAMILIES
from minimoe.core.routing_methods.methods import set_router
from minimoe.core.routing_methods.routing import moe_blocks
from minimoe.integrations.hf_export import export_merged, export_peft
from minimoe.loading.checkpoint import from_pretrained, save_pretrained
from minimoe.making.tiny import tiny_checkpoint
from minimoe.runs.adapters import save_adapter
from minimoe.runs.config import build_config
from minimoe.runs.training import install_method

# (family, method, tune_router): CE and ACS, with and without affinity tuning, on Granite and OLMoE; ESFT, whose
# router state (its choice of experts) is training's and stays out of the export
CASES = [("granitemoe", "native", False), ("granitemoe", "acs", True), ("olmoe", "native", True), ("olmoe", "acs", False),
         ("olmoe", "esft", False)]


def trained(family: str, method: str, tune_router: bool):
    """A tiny model with every LoRA tensor and the tuned gates moved away from their init, as training would."""
    model = tiny_model(family)
    set_router(model, method, layers="final", tune_router=tune_router)
    add_lora(model, rank=4, alpha=12, dropout=0.05, targets=["q", "k", "v", "o", "experts"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def ids(B: int = 2, T: int = 16):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(5))


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family,method,tune_router", CASES)
def test_peft_loads_the_export_with_our_logits(family, method, tune_router, tmp_path):
    """PeftModel.from_pretrained(transformers model, export) = our model with the adapter, every key
    matched (no missing or unexpected adapter keys), and the adapter moves the logits."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = trained(family, method, tune_router)
    save_pretrained(tiny_model(family), tmp_path / "base")
    save_adapter(model, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    export_peft(tmp_path / "adapter", tmp_path / "peft")

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    assert config["lora_dropout"] == (0.0 if family == "granitemoe" else 0.05)  # ParamWrapper needs 0
    assert config["modules_to_save"] == ({"granitemoe": ["model.layers.1.block_sparse_moe.router.layer"],
                                          "olmoe": ["model.layers.1.mlp.gate"]}[family] if tune_router else None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    ours = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    theirs = {k: v.shape for k, v in peft.get_peft_model_state_dict(hf).items()}
    assert {k: v.shape for k, v in ours.items()} == theirs
    with torch.no_grad():
        want, got = model(ids()).logits, hf(ids()).logits
        with hf.disable_adapter():
            base = hf(ids()).logits
    assert rel_err(base, want) > 1e-2  # the adapter matters, so the comparison has teeth
    assert rel_err(got, want) <= 2e-5


def test_export_from_the_model_equals_export_from_its_folder_and_run(tmp_path):
    """export_peft(model), export_peft(adapter folder) and the CLI on a run folder write the same tensors."""
    model = trained("olmoe", "acs", True)
    run = tmp_path / "run"
    save_adapter(model, run / "checkpoints" / "epoch-2", base_model="tiny-base")
    (run / "config.json").write_text("{}")
    (run / "selection.json").write_text(json.dumps({"last_epoch": 2, "selected_epoch": 2}))
    export_peft(model, tmp_path / "a", base_model="tiny-base")
    main([str(run), str(tmp_path / "b")])
    a, b = (load_file(str(tmp_path / x / "adapter_model.safetensors")) for x in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "b" / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-base"
    with pytest.raises(ValueError, match="base model is not recorded.*pass base_model="):
        export_peft(model, tmp_path / "c")


@pytest.mark.parametrize("method", ["tes", "dual"])
def test_tes_and_dual_are_refused_by_both_exports(method, tmp_path):
    """Their heads change the routing function: export_peft and export_merged refuse, saying why, and write nothing."""
    model = trained("granitemoe", method, False)
    save_adapter(model, tmp_path / "adapter", base_model="tiny-base")
    for export, src in ((export_peft, tmp_path / "adapter"), (export_peft, model)):
        with pytest.raises(ValueError, match=f"export_peft: refused for method '{method}'.*routing function"):
            export(src, tmp_path / "peft", base_model="tiny-base")
    with pytest.raises(ValueError, match=f"export_merged: refused for method '{method}'.*routing function"):
        export_merged(model, tmp_path / "merged")
    assert not (tmp_path / "peft").exists() and not (tmp_path / "merged").exists()


def assert_merged_gives_our_logits(transformers, model, tmp_path):
    """transformers alone loads export_merged_run's tmp_path/merged and gives `model`'s logits, which the
    saved base's differ from (what trained, an adapter or ESFT's rows, matters)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got, before = model(ids()).logits, hf(ids()).logits, base(ids()).logits
    assert rel_err(before, want) > 1e-2
    assert rel_err(got, want) <= 2e-5


def export_merged_run(model, family: str, tmp_path):
    """A run folder whose adapter is `model`'s, on a saved tiny `family` base (tmp_path/base, with the tokenizer),
    exported by `export.py RUN OUT --merged` into tmp_path/merged; returns the run folder."""
    save_pretrained(tiny_model(family), tmp_path / "base")
    shutil.copyfile(tiny_checkpoint() / "tokenizer.json", tmp_path / "base" / "tokenizer.json")
    run = tmp_path / "run"
    save_adapter(model, run / "checkpoints" / "epoch-1", base_model=str(tmp_path / "base"))
    (run / "config.json").write_text(json.dumps({"model": str(tmp_path / "base")}))
    (run / "selection.json").write_text(json.dumps({"last_epoch": 1, "selected_epoch": 1}))
    main([str(run), str(tmp_path / "merged"), "--merged"])
    return run


@pytest.mark.parametrize("family,method,tune_router", [CASES[1], CASES[2]])
def test_merged_export_cli_loads_in_transformers_with_our_logits(family, method, tune_router, tmp_path):
    """`export.py RUN OUT --merged`: the base the run records, its adapter merged in; transformers alone
    loads the folder (tokenizer files included) and gives our logits with the adapter."""
    transformers = pytest.importorskip("transformers")
    model = trained(family, method, tune_router)
    export_merged_run(model, family, tmp_path)
    assert (tmp_path / "merged" / "tokenizer.json").read_bytes() == (tmp_path / "base" / "tokenizer.json").read_bytes()
    assert_merged_gives_our_logits(transformers, model, tmp_path)


def test_esft_full_form_merged_export_loads_in_transformers_with_our_logits(tmp_path):
    """ESFT's full form: `export.py RUN OUT --merged` writes the base with the chosen experts' trained rows in
    their banks; transformers gives our logits. Its peft export is refused, naming why."""
    transformers = pytest.importorskip("transformers")
    model = tiny_model("olmoe")
    add_lora(model, rank=4, alpha=12, dropout=0.0, targets=["q", "experts"])
    set_router(model, "esft", layers="all", esft_form="full")
    g = torch.Generator().manual_seed(1)
    for i, mlp in moe_blocks(model).items():
        mlp.router.chosen.copy_(torch.arange(8) % 3 == i % 3)
        mlp.router.take_rows(mlp)
        with torch.no_grad():
            for rows in mlp.router.rows.values():
                rows.add_(torch.randn(rows.shape, generator=g) * 0.1)
    model.eval()
    run = export_merged_run(model, "olmoe", tmp_path)
    assert_merged_gives_our_logits(transformers, model, tmp_path)
    with pytest.raises(ValueError, match="trains expert weights in full.*peft's LoRA cannot hold"):
        export_peft(run / "checkpoints" / "epoch-1", tmp_path / "peft")


def test_merged_export_cli_refuses_tes_before_loading_anything(tmp_path, capsys):
    model = trained("granitemoe", "tes", False)
    save_adapter(model, tmp_path / "adapter", base_model=str(tmp_path / "no-such-base"))
    with pytest.raises(SystemExit) as exit_:  # one line, status 2, no traceback
        main([str(tmp_path / "adapter"), str(tmp_path / "merged"), "--merged"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("export.py: error: export.py --merged: refused for method 'tes'")
    assert not (tmp_path / "merged").exists()


def test_merged_export_rounds_a_tuned_fp32_gate_to_the_model_dtype(tmp_path):
    """The official layout has one dtype: a tuned gate is written rounded to bf16 once, and the model
    keeps its fp32 gate afterwards."""
    model = tiny_model("olmoe").to(torch.bfloat16)
    install_method(model, build_config({"method": "ce", "tune_router": True}, "olmoe"))
    gate = model.model.layers[-1].mlp.gate
    with torch.no_grad():
        gate.weight.add_(1e-4)  # a trained gate that bf16 cannot hold exactly
    before = gate.weight.detach().clone()
    export_merged(model, tmp_path / "merged")
    tensors = load_file(tmp_path / "merged" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    key = f"model.layers.{len(model.model.layers) - 1}.mlp.gate.weight"
    assert torch.equal(tensors[key], before.to(torch.bfloat16))
    assert gate.weight.dtype == torch.float32 and torch.equal(gate.weight, before)


def test_export_errors_name_only_export_flags(tmp_path, capsys):
    """Issue 41 item 7: export.py's errors named --adapter, a flag it does not have. Each refusal here
    (no such folder, a model folder as RUN, a merge into other weights) names only export.py's own
    flags, and the one it suggests (--allow-other-base) does what it says."""
    with pytest.raises(SystemExit):
        main(["--help"])
    flags = set(re.findall(r"--[a-z][a-z-]+", capsys.readouterr().out))
    model = add_lora(from_pretrained(tiny_checkpoint()))
    save_adapter(model, tmp_path / "adapter", base_model=str(tiny_checkpoint()))
    other = from_pretrained(tiny_checkpoint())
    with torch.no_grad():
        next(other.parameters()).add_(0.01)  # the same shapes, other weights
    save_pretrained(other, tmp_path / "other")
    messages = []
    for argv in ([str(tmp_path / "nowhere"), str(tmp_path / "out")], [str(tiny_checkpoint()), str(tmp_path / "out")],
                 [str(tmp_path / "adapter"), str(tmp_path / "out"), "--merged", "--model", str(tmp_path / "other")]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        messages.append(capsys.readouterr().err)
        assert exit_.value.code == 2 and messages[-1].startswith("export.py: error: "), messages[-1]
    assert "--allow-other-base" in messages[-1]
    named = {f for m in messages for f in re.findall(r"--[a-z][a-z-]+", m)}
    assert named <= flags, f"export.py's errors name {sorted(named - flags)}, which export.py does not have: {messages}"
    main([str(tmp_path / "adapter"), str(tmp_path / "out"), "--merged", "--model", str(tmp_path / "other"),
          "--allow-other-base"])
    assert (tmp_path / "out" / "config.json").is_file()


# ----------------------------------------------------------------------------- for transformers 5 (its fused experts)

# peft refuses a LoRA on Nemotron-H's Mamba out_proj (export_peft too: test below); the rest of its default targets
TF5_TARGETS = {"nemotron_h": ("q", "k", "v", "o", "experts", "mamba_in")}


@pytest.mark.tf5
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_peft_on_transformers_5_loads_the_export_with_our_logits(model_type, tmp_path):
    """Every family's LoRA (its default targets: the routed experts, attention and its mixers), trained off zero and
    exported with transformers=5, loads into peft 0.21.2 on transformers 5.23 (which holds the experts fused, as
    3-D parameters: peft's target_parameters) from a checkpoint transformers 5.23 saved: every key matched, fp32
    logits within 2e-5 of ours, and the experts' LoRA in them (logits without it off by > 1e-2)."""
    from tests.core.decoder.test_families_parity import assert_peft_loads_the_export, with_trained_lora
    from tests.loading.test_config_keys import tiny
    model = with_trained_lora(model_type, tmp_path / "base", seed=1, targets=TF5_TARGETS.get(model_type),
                              config=tiny(model_type)).eval()
    assert_peft_loads_the_export(model, tmp_path, transformers=5)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {p.rpartition(".")[2] for p in config["target_parameters"]} >= {"down_proj"}
    ids_ = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids_).logits
        for m in model.modules():  # the experts' LoRA off: what an export without it would give
            if isinstance(m, LoRAGroupedLinear):
                m.lora_B.zero_()
        assert rel_err(model(ids_).logits, want) > 1e-2


@pytest.mark.tf5
@pytest.mark.parametrize("family,method", [("granitemoe", "acs"), ("mixtral", "native")])
def test_a_tuned_gate_exports_for_transformers_5_where_it_renamed_the_router(family, method, tmp_path):
    """A tuned gate goes to modules_to_save under transformers 5's path for it (Granite's block_sparse_moe.router,
    Mixtral's mlp.gate: its checkpoint's block_sparse_moe.router.layer and block_sparse_moe.gate), and loads with our
    logits."""
    from tests.core.decoder.test_families_parity import assert_peft_loads_the_export
    model = trained(family, method, True)
    save_pretrained(tiny_model(family), tmp_path / "base")
    assert_peft_loads_the_export(model, tmp_path, transformers=5)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == [{"granitemoe": "model.layers.1.block_sparse_moe.router",
                                          "mixtral": "model.layers.1.mlp.gate"}[family]]


# families whose gate module in transformers holds more than the weight: gpt-oss's router bias, the selection bias
GATE_WITH_BIAS = [("gpt_oss", 4), ("deepseek_v3", 4),
                  *(pytest.param(f, 5, marks=pytest.mark.tf5) for f in ("deepseek_v32", "kimi_linear", "nemotron_h"))]


@pytest.mark.parametrize("family,transformers", GATE_WITH_BIAS)
def test_a_tuned_gate_exports_with_the_frozen_tensors_of_its_module(family, transformers, tmp_path):
    """peft's modules_to_save copies the gate's whole module, so the export of a model carries the gate's bias
    beside its tuned weight (peft raised a KeyError without it), and loads with our logits."""
    if transformers_major() != transformers:
        pytest.skip(f"an export for transformers {transformers}, loaded by it")
    from tests.core.decoder.test_families_parity import assert_peft_loads_the_export
    model = trained(family, "native", True)
    save_pretrained(tiny_model(family), tmp_path / "base")
    assert_peft_loads_the_export(model, tmp_path, transformers=transformers, from_model=True)


def test_a_tuned_gate_without_its_bias_is_refused_by_name(tmp_path):
    """An adapter folder holds the tuned gate's weight only: for a gate whose module holds a bias too, the export
    says what is missing and what to do, before writing anything."""
    model = trained("deepseek_v3", "native", True)
    save_adapter(model, tmp_path / "adapter", base_model="tiny-base")
    with pytest.raises(ValueError, match=r"mlp\.gate.*e_score_correction_bias.*export the loaded model"):
        export_peft(tmp_path / "adapter", tmp_path / "peft")
    assert not (tmp_path / "peft").exists()


def test_export_for_transformers_5_names_fused_experts_and_keeps_the_scale(tmp_path):
    """OLMoE for transformers 5 (export.py --transformers 5): its experts as target_parameters, our gate and up
    LoRAs (rank 4 each) as one of rank 8 on gate_up_proj with alpha doubled (rank_pattern, alpha_pattern): the
    scale alpha/r kept, B block-diagonal. No oracle: the peft load itself is the tf5 test above."""
    model = trained("olmoe", "native", False)
    save_adapter(model, tmp_path / "adapter", base_model="tiny-base")
    main([str(tmp_path / "adapter"), str(tmp_path / "peft"), "--transformers", "5"])
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert config["target_modules"] == ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert config["rank_pattern"] == {"experts.gate_up_proj": 8} and config["alpha_pattern"] == {"experts.gate_up_proj": 24}
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    inner = "base_model.model.model.layers.0.mlp.experts.base_layer"  # gate_up_proj's wrapper, inside down_proj's
    A, B = tensors[f"{inner}.lora_A.weight"], tensors[f"{inner}.lora_B.weight"]  # [E*8, D], [2I, 8*E]
    lora = model.model.layers[0].mlp.experts.gate_up_proj
    E, I = lora.lora_A.shape[0], lora.lora_B.shape[1] // 2
    B_e = B.reshape(2 * I, 8, E).permute(2, 0, 1)  # [E, 2I, 8], the expert fastest in peft's columns
    delta = (24 / 8) * B_e @ A.reshape(E, 8, -1)
    assert torch.allclose(delta, lora.delta_weight(), atol=1e-6)
    assert not B_e[:, :I, 4:].any() and not B_e[:, I:, :4].any()  # gate rows read only gate's A rows


def test_export_refuses_a_transformers_it_cannot_write_for(tmp_path, capsys):
    """A transformers-5-only family for transformers 4 (4.57 does not hold it), a version other than 4 or 5, and
    Nemotron-H's Mamba out_proj LoRA (peft refuses it) are refused by name, before anything is written; --merged
    with --transformers is a usage error."""
    qwen35 = add_lora(tiny_model("qwen3_5_moe"), rank=4, alpha=8, dropout=0.0)
    with pytest.raises(ValueError, match="transformers 4.57 does not hold qwen3_5_moe; export it for transformers 5"):
        export_peft(qwen35, tmp_path / "peft", base_model="x", transformers=4)
    with pytest.raises(ValueError, match="transformers=3; expected 4 or 5"):
        export_peft(qwen35, tmp_path / "peft", base_model="x", transformers=3)
    nemotron = add_lora(tiny_model("nemotron_h"), rank=4, alpha=8, dropout=0.0)
    with pytest.raises(ValueError, match="peft refuses LoRA on nemotron_h's Mamba out_proj.*mamba_out target"):
        export_peft(nemotron, tmp_path / "peft", base_model="x")
    assert not (tmp_path / "peft").exists()
    save_adapter(qwen35, tmp_path / "adapter", base_model="x")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "adapter"), str(tmp_path / "out"), "--merged", "--transformers", "5"])
    assert "--transformers names the transformers a peft adapter is written for" in capsys.readouterr().err
