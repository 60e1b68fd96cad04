"""minimoe.integrations.lm_eval against lm-evaluation-harness's own `hf` model on transformers, offline: a task defined
here on local JSONL files, the same tiny checkpoint folder; TES through an adapter against a plain forward of each
context + continuation; and a transformers-saved checkpoint of another family.

The other families in CI are DeepSeek-V3 and Llama 4 (FAMILIES_IN_CI). MiniMoELM has no code per family: what differs between
families is the forward, which tests/core/decoder/test_model.py and tests/core/decoder/test_families_parity.py hold to transformers
for every family through the same from_pretrained. DeepSeek-V3 is the one whose folder needs more than its weights
here (a tokenizer_config.json: without one, lm-eval's hf model takes Llama's tokenizer class); Llama 4 stands for issue
49's round (NoPE and chunked attention layers, top-1 routing). The others agreed when
the test was written; MINIMOE_ALL_FAMILIES=1 runs them all (tests/conftest.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from minimoe.core.adaptation.lora import add_lora  # noqa: E402
from minimoe.core.routing_methods.methods import set_router  # noqa: E402
from minimoe.data.benchmarks import load_split  # noqa: E402
from minimoe.integrations.lm_eval import MiniMoELM, write_mcqa_task  # noqa: E402
from minimoe.loading.checkpoint import from_pretrained, save_pretrained  # noqa: E402
from minimoe.making.tiny import tiny_checkpoint  # noqa: E402
from minimoe.runs.adapters import save_adapter  # noqa: E402
from tests.conftest import only_in_the_full_matrix  # noqa: E402
from tests.test_families_pipeline import FAMILY_SWITCHES, ROUND2, VARIANTS, saved  # noqa: E402

TASK = "minimoe_local_mcqa"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """The tiny OLMoE with its weights scaled up, so that log-likelihoods spread and rankings mean something;
    saved with its tokenizer, so lm-eval's hf model (AutoTokenizer) loads the same folder."""
    folder = tmp_path_factory.mktemp("sharp")
    model = from_pretrained(tiny_checkpoint())
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    save_pretrained(model, folder)
    (folder / "tokenizer.json").write_bytes((tiny_checkpoint() / "tokenizer.json").read_bytes())
    return folder


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    return write_mcqa_task(root / "task", TASK, load_split("arc_challenge", "val", data_dir=root / "splits", seed=42)[:24])


@pytest.fixture(scope="module")
def task_manager(task_dir):
    """lm-eval's index of its own tasks and ours: built once, as lm-eval's CLI does (indexing its thousands of
    task files was most of these tests' time, once for every evaluation)."""
    return TaskManager(include_path=str(task_dir))


def evaluate(model, model_args, task_manager):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=task_manager, batch_size=4,
                                   log_samples=True, random_seed=0)


def scores_as_lm_evals_hf_model(folder, task_manager):
    """Our model scores the local task on `folder` as lm-eval's own hf model scores it on transformers."""
    ours = evaluate("minimoe", f"pretrained={folder},dtype=float32", task_manager)
    theirs = evaluate("hf", f"pretrained={folder},dtype=float32,device=cpu", task_manager)
    a, b = ours["results"][TASK], theirs["results"][TASK]
    assert (a["acc,none"], a["acc_norm,none"]) == (b["acc,none"], b["acc_norm,none"])
    ll = lambda result: [r[0] for s in result["samples"][TASK] for r in s["filtered_resps"]]
    assert ll(ours) == pytest.approx(ll(theirs), abs=1e-4)
    assert len(set(round(x, 3) for x in ll(ours))) > len(ll(ours)) // 2  # spread, not a constant


def test_local_task_scores_as_lm_evals_hf_model(sharp, task_manager):
    scores_as_lm_evals_hf_model(sharp, task_manager)


def test_the_console_command_is_lm_evals_own_cli_with_minimoe_registered(sharp, task_dir, task_manager, tmp_path):
    """minimoe-lm-eval (setup.cfg's target, minimoe.cli.lm_eval_harness:command) hands its argv to lm-eval's CLI unchanged:
    lm-eval's own flags act (--include_path, --limit, --output_path, --log_samples, the legacy form without
    `run`), and the results file holds the scores and log-likelihoods of simple_evaluate in this process."""
    out = tmp_path / "out"
    flags = ["--model", "minimoe", "--model_args", f"pretrained={sharp},dtype=float32", "--include_path", str(task_dir),
             "--tasks", TASK, "--limit", "6", "--batch_size", "4", "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "from minimoe.cli.lm_eval_harness import command; command()", *flags], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()]
    here = lm_eval.simple_evaluate(model="minimoe", model_args=f"pretrained={sharp},dtype=float32", tasks=[TASK],
                                   task_manager=task_manager, batch_size=4, limit=6,
                                   log_samples=True)
    assert (results["acc,none"], results["acc_norm,none"]) == \
        (here["results"][TASK]["acc,none"], here["results"][TASK]["acc_norm,none"])
    ll = lambda rows: [float(r[0]) for s in sorted(rows, key=lambda s: s["doc_id"]) for r in s["filtered_resps"]]
    assert len(samples) == 6 and ll(samples) == pytest.approx(ll(here["samples"][TASK]), abs=1e-6)


def test_rolling_and_generation_equal_the_hf_model(sharp):
    from lm_eval.models.huggingface import HFLM
    ours = MiniMoELM(pretrained=str(sharp), dtype="float32", batch_size=2)
    theirs = HFLM(pretrained=str(sharp), dtype="float32", device="cpu", batch_size=2)
    texts = ["The sky is blue because light scatters.", "Water boils at one hundred degrees", " x"]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(theirs.loglikelihood_rolling(rolling), abs=1e-3)
    generation = [Instance("generate_until", {}, (t, {"until": ["."], "max_gen_toks": 8, "do_sample": False}), i)
                  for i, t in enumerate(texts)]
    assert ours.generate_until(generation) == theirs.generate_until(generation)


def test_tes_adapter_scores_each_request_as_a_plain_forward(sharp, tmp_path):
    """A TES model (no transformers counterpart): the packed rows' log-likelihoods equal a forward of each
    context + continuation alone, and differ from the base model's (the head is used)."""
    model = from_pretrained(sharp)
    set_router(model, "tes", layers="all")
    add_lora(model, rank=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    save_adapter(model, tmp_path / "adapter", base_model=str(sharp))
    ours = MiniMoELM(adapter=str(tmp_path / "adapter"), dtype="float32", batch_size=3)
    base = MiniMoELM(pretrained=str(sharp), dtype="float32", batch_size=3)
    context = "Question: Which gas do plants take in?\nAnswer:"
    requests = [Instance("loglikelihood", {}, (context, f" {c}"), i)
                for i, c in enumerate(["carbon dioxide", "oxygen", "nitrogen gas"])]
    requests.append(Instance("loglikelihood", {}, ("Another context:", " yes"), 3))
    got = [ll for ll, _ in ours.loglikelihood(requests)]
    model.eval()
    want = []
    for request in requests:
        ctx, cont = ours._encode_pair(*request.args)
        with torch.no_grad():
            logp = model(torch.tensor([ctx + cont])).logits[0].float().log_softmax(-1)
        want.append(sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)))
    assert got == pytest.approx(want, abs=1e-4)
    assert max(abs(a - b) for a, (b, _) in zip(got, base.loglikelihood(requests))) > 1e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where CUDA is missing")
def test_the_cli_default_device_falls_back_to_the_cpu_without_cuda(sharp):
    """lm-eval's CLI passes device=cuda:0 unless told otherwise; as its hf model, we then run on the CPU."""
    assert MiniMoELM(pretrained=str(sharp), device="cuda:0").model.device.type == "cpu"


# ---- another family: a checkpoint that transformers saved ----------------------------------------------------

ALL = [*FAMILY_SWITCHES, *VARIANTS, *ROUND2]
FAMILIES_IN_CI = ["deepseek_v3", "llama4_text"]  # and one of issue 49's: NoPE and chunked layers under lm-eval's batching


@pytest.mark.parametrize("name", ALL)
def test_another_familys_transformers_saved_checkpoint_scores_as_lm_evals_hf_model(name, task_manager, tmp_path,
                                                                                  monkeypatch):
    if name not in FAMILIES_IN_CI:
        only_in_the_full_matrix("one family in CI (this file's docstring says why)")
    scores_as_lm_evals_hf_model(saved(name, tmp_path, monkeypatch), task_manager)
