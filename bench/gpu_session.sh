#!/bin/bash
# One GPU session's checks in one command (docs/gpu.md, "The next GPU session"): the pinned wheels, the CUDA
# tests, then bench/gpu.py in two parts, every log and table into OUT. Run from the repository root:
#   OUT=out WHEELS=.whl DEFAULT_MODEL=weights/smollm2-135m-moe bash bench/gpu_session.sh
# WHEELS: transformers 4.57.6, peft 0.21.2, huggingface-hub 0.36.2, tokenizers 0.22.2, gguf, torchao (bench/README.md).
# DEFAULT_MODEL: a folder with the default model's config.json and tokenizer files (random weights of its shape).
# MINIMOE_CACHE: where the SciQ files are (a copy of ~/.cache/minimoe), for the default stage.
set -u
: "${OUT:=out}" "${WHEELS:=.whl}" "${DEFAULT_MODEL:=weights/smollm2-135m-moe}" "${SECONDS_IN_ALL:=560}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
  > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
python3 -m compileall -q -j 16 /tmp/site > /dev/null 2>&1  # else each process compiles transformers' source
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'peft', peft.__version__)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
elapsed() { echo $(( SECONDS )); }
# The CUDA tests first: a failure's traceback is what the next session needs most.
timeout 170 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider -rfE --tb=short --durations=10 \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc $? at $(elapsed) s"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log" | tail -30
timeout -s TERM 250 python3 bench/gpu.py --time-limit 235 --out gpu --default-model "$DEFAULT_MODEL" \
  --only parity,copies,attention,granite8,olmoe8,nf4,compile,default > "$OUT/bench.log" 2>&1
echo "bench rc $? at $(elapsed) s"; cp bench/results/gpu.md bench/results/gpu.jsonl "$OUT/" 2>/dev/null
left=$(( SECONDS_IN_ALL - $(elapsed) ))
if [ "$left" -gt 40 ]; then
  timeout -s TERM "$left" python3 bench/gpu.py --time-limit $(( left - 12 )) --out gpu_families \
    --only qwen3,deepseek3,granite4h,qwen3next,qwen35,deepseek32,gemma4,baselines,chat >> "$OUT/bench.log" 2>&1
  cp bench/results/gpu_families.md bench/results/gpu_families.jsonl "$OUT/" 2>/dev/null
fi
cat "$OUT"/gpu*.md 2>/dev/null
