# Issue 7's GPU measurements in one device call, from the repo root with the torchao wheel carried in .whl/
# (time limits sum to 530 s; run at stop 36 as call 1, benchmarks/RESULTS.md): the reference step profiled (Inductor,
# our FP8 with and without drop_logits, torchao float8), then 300-step loss runs on real text in parallel
# processes, pooled by mode (bf16, ours, torchao, and fp8_variants.py's ablations). STEP_S / LOSS_S: each
# part's time limit.
source benchmarks/gpu_setup.sh
cd benchmarks
D=$(date +%F)
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch, triton, transformers, torchao; print(torch.__version__, triton.__version__, transformers.__version__, torchao.__version__)"
BENCH_NAME=$D-llama-step-fused-loss.json timeout ${STEP_S:-240} python3 bench_llama_step.py --steps 20 --profile --modes inductor_cg fusion_fp8_tensorwise_drop_cg fusion_fp8_tensorwise_cg torchao_fp8_cg > $OUT/step.log 2>&1
echo "step rc=$?"
L=$D-fp8-train
launch() {  # name, then the command's words
  local name=$1; shift
  TORCHINDUCTOR_COMPILE_THREADS=2 TORCHINDUCTOR_CACHE_DIR=/tmp/ic-$name BENCH_NAME=$L-$name.json \
    timeout ${LOSS_S:-290} "$@" --parts train --data text --layers 4 --repeats 2 > $OUT/$name.log 2>&1 &
}
launch bf16-a python3 bench_fp8.py --train-modes bf16
launch bf16-b python3 bench_fp8.py --train-modes bf16
launch tw-a python3 bench_fp8.py --train-modes fp8_tensorwise
launch tw-b python3 bench_fp8.py --train-modes fp8_tensorwise
launch torchao python3 bench_fp8.py --train-modes torchao_tensorwise
launch headbf16 python3 fp8_variants.py head_bf16 bench_fp8.py --train-modes fp8_tensorwise
launch dybf16 python3 fp8_variants.py dy_bf16 bench_fp8.py --train-modes fp8_tensorwise
launch e4m3dy python3 fp8_variants.py e4m3_dy bench_fp8.py --train-modes fp8_tensorwise
wait
for f in $OUT/*.log; do echo "== $(basename $f) $(grep -c 'step' $f)"; grep -E "Error" $f | tail -2; done
tail -8 $OUT/step.log
python3 - <<'PY'
import json, os, glob
for f in glob.glob(os.environ["OUT"] + "/*llama-step*.json"):
    for r in json.load(open(f))["rows"]:
        print(r.get("mode"), r.get("step_ms"), r.get("gpu_ms"), r.get("peak_GiB"), r.get("loss0"))
        for k in (r.get("kernels") or [])[:16]:
            print("   ", k[0][:70], k[1], k[2])
PY
cd $OUT && python3 $OLDPWD/bench_fp8.py --parts none --summarize $L-*.json
