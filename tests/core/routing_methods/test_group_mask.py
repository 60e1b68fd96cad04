"""The experts of the groups a group-limited router drops: transformers 5.23 scores them -inf (DeepSeek's own
inference code does too; 4.57 scored them 0; Mistral 4's softmax router, whose scores are all above 0 and which has
no selection bias, fills 0 and is not held here). The two differ only where fewer than K
kept experts have a bias-corrected score above 0; the parity draws rarely reach that, so here the selection bias
is pushed below 0 for every expert and each record must pick what transformers picks."""
import pytest
import torch

import minimoe
from tests.conftest import by_oracle
from tests.core.decoder.test_model import FP32_TOL, batch, reference_model, rel_err, tiny

# model_type -> the tiny config's overrides that make two groups, one kept
GROUPED = {"glm4_moe_lite": {}, "deepseek_v32": {}, "glm_moe_dsa": {"n_group": 4, "topk_group": 2},
           "nemotron_h": {}, "mimo_v2_flash": {}}


@pytest.mark.parametrize("family", by_oracle(GROUPED))
def test_dropped_groups_score_as_transformers_scores_them(family, tmp_path):
    ref = reference_model(tiny(family, **GROUPED[family]), tmp_path / "ref")
    with torch.no_grad():  # every corrected score below 0: a 0 fill and a -inf fill pick different experts
        biases = [b for name, b in ref.named_buffers() if name.endswith("e_score_correction_bias")]
        assert biases, f"{family}'s tiny model has no selection bias"
        for b in biases:
            b.copy_(-3.0 + 0.5 * torch.randn_like(b))
    ref.save_pretrained(tmp_path / "ref")
    ours = minimoe.from_pretrained(tmp_path / "ref", dtype=torch.float32)
    ids, mask = batch(ours)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    assert rel_err(got, want, mask) <= FP32_TOL
