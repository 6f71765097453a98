# Issue 7's goals on the current code, one device call (from the repo root, the torchao wheel carried in
# .whl/): the reference step (Inductor, ours in FP8 with and without drop_logits, torchao), then 300-step
# loss runs on real text at a peak learning rate of 3e-4 (1e-3 ends 6.8% higher in bf16 itself, stop 36):
# bf16 x3, ours x3 (tensorwise, the logits returned, so the loss's gradient cast takes its dy path and the
# transposed copy) and torchao x1 in parallel processes (8 files in all), pooled by mode. LOSS_S: each
# process's time limit. Then plot on this machine: plot_fp8.py over the returned files.
source benchmarks/gpu_setup.sh
cd benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -z "$NO_STEP" ]; then  # NO_STEP=1: the loss runs only
  BENCH_NAME=$(date +%F)-llama-step-final.json timeout 240 python3 bench_llama_step.py --steps 20 \
    --modes inductor_cg fusion_fp8_tensorwise_drop_cg fusion_fp8_tensorwise_cg torchao_fp8_cg > /tmp/step.log 2>&1
  echo "step rc=$?"; grep -E "^\| (inductor|fusion|torchao)" /tmp/step.log
fi
L=$(date +%F)-fp8-lr3e-4
launch() {  # name, then the command's words
  local name=$1; shift
  TORCHINDUCTOR_COMPILE_THREADS=2 TORCHINDUCTOR_CACHE_DIR=/tmp/ic-$name BENCH_NAME=$L-$name.json \
    timeout ${LOSS_S:-250} "$@" --parts train --data text --layers 4 --repeats 2 --lr 3e-4 \
    --mode-prefix lr3e-4: > /tmp/$name.log 2>&1 &
}
for i in a b c; do launch bf16-$i python3 bench_fp8.py --train-modes bf16; done
for i in a b c; do launch tw-$i python3 bench_fp8.py --train-modes fp8_tensorwise; done
launch torchao-a python3 bench_fp8.py --train-modes torchao_tensorwise
wait
for f in /tmp/bf16-*.log /tmp/tw-*.log /tmp/torchao-*.log; do echo "== $(basename $f)"; grep -E "Error" $f | tail -2; done
cd $OUT && python3 $OLDPWD/bench_fp8.py --parts none --summarize $L-*.json
