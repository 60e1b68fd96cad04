"""minimoe as an lm-evaluation-harness model, for any method (TES and Dual Affinity included).

    pip install -e ".[lmeval]"
    minimoe-lm-eval --model minimoe --model_args pretrained=weights/tiny-olmoe,adapter=runs/<run> \\
        --tasks arc_easy --batch_size 8
    # in Python, after `import minimoe.integrations.lm_eval`: lm_eval.simple_evaluate(model="minimoe", model_args=...)

model_args: pretrained (a checkpoint folder or hub id; default: the adapter's base model), adapter (a
train.py run folder or an adapter folder), checkpoint (last | selected, for a run folder), revision,
dtype (auto | float32 | bfloat16), device (auto | cpu | cuda), max_length (default: the model's
max_position_embeddings), allow_other_base; --batch_size is contexts per forward.

`minimoe-lm-eval ARGS` (= `python -m minimoe.integrations.lm_eval ARGS`) is `lm_eval ARGS`, lm-eval's own CLI with its
argv unchanged, in a process that has registered this model. lm-eval 0.4.13 finds models only in its own
table (lm_eval.models.MODEL_MAPPING) and in classes registered by modules already imported; it does not read
the `lm_eval.models` entry point that setup.cfg declares (kept for harness versions that do), so the plain
`lm_eval --model minimoe` fails there.

Decisions (matching lm-eval's `hf` model, which the tests compare against on the same folder):
- Tokens: no special tokens; a context's trailing spaces move to the continuation; the
  continuation's tokens are those of context + continuation past the context's (HFLM._encode_pair).
  An empty context becomes the prefix token (bos, else eos).
- loglikelihood: requests with the same context tokens are one packed row (minimoe/core/task/choices.py): the
  context runs once and every continuation attends to it alone, as in our answer-choice scoring.
  Contexts longer than max_length lose their start (enough for the longest continuation of the row).
- loglikelihood_rolling: lm-eval's disjoint rolling windows of max_length tokens, each scored as a
  loglikelihood request, summed.
- generate_until: greedy (or sampled with temperature > 0) decoding with the KV cache
  (minimoe/core/decoder/generate.py), left-padded batches, cut at the first stop string; rows run to
  max_gen_toks or eos.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import lm_eval.models  # noqa: F401  lm-eval's own table first: get_model() skips it once the registry is not empty
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from minimoe.core.task.choices import pad_id
from minimoe.core.task.choices import forward_choices, pack_choices
from minimoe.core.decoder.generate import generate
from minimoe.loading.hub import resolve_checkpoint
from minimoe.runs.device import pick_device
from minimoe.runs.eval_run import load_model
from minimoe.runs.run_folder import read_json, resolve_adapter

log = logging.getLogger(__name__)


MCQA_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_mcqa_task(folder, name: str, examples) -> Path:
    """minimoe's MCQA examples (minimoe.data.benchmarks.Example) as an lm-eval task on local JSONL, with lm-eval's ARC
    prompt, choices and metrics: folder/test.jsonl and folder/task.yaml, for `--include_path folder --tasks name`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "test.jsonl", "w") as f:
        for ex in examples:
            f.write(json.dumps({"question": ex.question, "choices": list(ex.choices), "answer": ex.answer}) + "\n")
    (folder / "task.yaml").write_text(MCQA_TASK.format(name=name, data=(folder / "test.jsonl").resolve()))
    return folder


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("minimoe")
class MiniMoELM(LM):
    def __init__(self, pretrained: str | None = None, adapter: str | None = None, checkpoint: str | None = None,
                 revision: str | None = None, dtype: str = "auto", device: str = "auto", batch_size=8,
                 max_length: int | None = None, allow_other_base=False, **unused):
        super().__init__()
        source = resolve_adapter(adapter, checkpoint) if adapter else None
        run_config = source.run_config if source else {}
        if source is not None and pretrained is None:  # the run's model, else the base the adapter records
            pretrained = run_config.get("model") or read_json(source.folder / "adapter_config.json").get("base_model")
        if pretrained is None:
            raise ValueError("model_args: pass pretrained=FOLDER_OR_HUB_ID (or adapter=RUN, whose config.json names it)")
        if revision is None and str(pretrained) == run_config.get("model"):
            revision = run_config.get("model_revision")
        if str(device).startswith("cuda") and not torch.cuda.is_available():  # lm-eval's CLI passes cuda:0 by default
            log.warning("device %s: no CUDA device is available; running on the CPU (as lm-eval's hf model does)", device)
            device = "cpu"
        torch_device = pick_device(device)
        folder = resolve_checkpoint(pretrained, run_config.get("cache_dir"), revision)
        self.model, self.tokenizer = load_model(folder, source, device=torch_device, dtype=dtype,
                                                allow_other_base=_flag(allow_other_base))
        self.model.eval()
        config = self.model.config
        self.pad = pad_id(config)
        self.prefix_token = config.bos_token_id if config.bos_token_id is not None else config.eos_token_id
        self.max_length = int(max_length or config.max_position_embeddings)
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)  # no auto-sizing: 8
        self._device = torch_device

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
        return ctx, whole[len(ctx):]

    # ------------------------------------------------------------------------- log-likelihoods

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            pairs.append(([self.prefix_token], self.tok_encode(continuation)) if context == ""
                         else self._encode_pair(context, continuation))
        return self._score_pairs(pairs, disable_tqdm)

    @torch.inference_mode()
    def _score_pairs(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = False):
        """(context ids, continuation ids) -> (sum of log p(continuation), every token greedy), in input order."""
        by_context: dict[tuple, list[int]] = {}
        for i, (context, _) in enumerate(pairs):
            by_context.setdefault(tuple(context), []).append(i)
        # longest rows first, so an out-of-memory shows at once; a packed row: the context, then each continuation
        groups = sorted(by_context.items(), key=lambda g: -(len(g[0]) + sum(len(pairs[i][1]) for i in g[1])))
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        for start in tqdm(range(0, len(groups), self.batch_size), desc="loglikelihood", unit="batch",
                          disable=disable_tqdm or self.rank != 0):
            chunk = groups[start:start + self.batch_size]
            rows = []
            for context, members in chunk:
                answers = [pairs[i][1] for i in members]
                keep = self.max_length + 1 - max(map(len, answers))  # lm-eval's window: max_length + 1 tokens
                rows.append((list(context)[-max(keep, 1):], answers))
            batch = pack_choices(rows, self.pad).to(self._device)
            out, logp = forward_choices(self.model, batch)  # logp [n]: every continuation token
            greedy = (out.logits.argmax(-1) == batch.target).long()  # [n]
            C = batch.choice.shape[0]
            total = logp.new_zeros(C).index_add(0, batch.cand, logp).tolist()
            all_greedy = torch.zeros(C, dtype=torch.long, device=logp.device).index_add(0, batch.cand, greedy)
            all_greedy = (all_greedy == batch.n_tokens).tolist()
            members = [i for _, m in chunk for i in m]  # candidate order of pack_choices
            for c, i in enumerate(members):
                results[i] = (total[c], bool(all_greedy[c]))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for r, request in enumerate(requests):
            windows = get_rolling_token_windows(token_list=self.tok_encode(request.args[0]),
                                                prefix_token=self.prefix_token, max_seq_len=self.max_length,
                                                context_len=1)
            for window in map(make_disjoint_window, windows):
                pairs.append(window)
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (logprob, _) in zip(owner, self._score_pairs(pairs, disable_tqdm)):
            totals[r] += logprob
        return totals

    # ------------------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].args[0]))
        results: list[str | None] = [None] * len(requests)
        for start in tqdm(range(0, len(order), self.batch_size), desc="generate_until", unit="batch",
                          disable=disable_tqdm or self.rank != 0):
            # one batch per settings: requests with other gen_kwargs wait for their own batch
            idx = order[start:start + self.batch_size]
            for settings in {repr(sorted(requests[i].args[1].items())) for i in idx}:
                same = [i for i in idx if repr(sorted(requests[i].args[1].items())) == settings]
                for i, text in zip(same, self._generate([requests[i].args[0] for i in same], requests[same[0]].args[1])):
                    results[i] = text
        return results

    def _generate(self, contexts: list[str], kwargs: dict) -> list[str]:
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        new = int(kwargs.get("max_gen_toks", 256))
        temperature = float(kwargs.get("temperature", 0.0)) if _flag(kwargs.get("do_sample", False)) else 0.0
        encoded = [self.tok_encode(c)[-(self.max_length - new):] or [self.prefix_token] for c in contexts]
        T = max(map(len, encoded))
        ids = torch.full((len(encoded), T), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, e in enumerate(encoded):  # left-padded: every row's last context token is at T - 1
            ids[r, T - len(e):], mask[r, T - len(e):] = torch.tensor(e), 1
        eos = self.model.config.eos_token_id
        out = generate(self.model, ids.to(self._device), new, attention_mask=mask.to(self._device),
                       temperature=temperature, eos_token_id=eos)
        texts = []
        for row in out[:, T:].tolist():
            if eos is not None and eos in row:
                row = row[:row.index(eos)]
            text = self.tokenizer.decode(row)
            for stop in until:
                text = text.split(stop)[0]
            texts.append(text)
        return texts


if __name__ == "__main__":  # python -m minimoe.integrations.lm_eval runs its command, minimoe/cli/lm_eval_harness.py
    import runpy
    runpy.run_module("minimoe.cli.lm_eval_harness", run_name="__main__")
