# Issue 7's loss goal, one device call (from the repo root, the torchao wheel carried in .whl/): 300-step
# loss runs on real text at a peak learning rate of 3e-4 (1e-3 ends 6.8% higher in bf16 itself, stop 36):
# bf16, ours (tensorwise, the logits returned, so the loss's gradient cast takes its dy path and the
# transposed copy) and torchao in parallel processes, pooled by mode. LOSS_S: each process's time limit.
source benchmarks/gpu_setup.sh
cd benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
L=$(date +%F)-fp8-lr3e-4
launch() {  # name, then the command's words
  local name=$1; shift
  TORCHINDUCTOR_COMPILE_THREADS=2 TORCHINDUCTOR_CACHE_DIR=/tmp/ic-$name BENCH_NAME=$L-$name.json \
    timeout ${LOSS_S:-250} "$@" --parts train --data text --layers 4 --repeats 2 --lr 3e-4 \
    --mode-prefix lr3e-4: > /tmp/$name.log 2>&1 &
}
for i in a b c; do launch bf16-$i python3 bench_fp8.py --train-modes bf16; done
for i in a b c; do launch tw-$i python3 bench_fp8.py --train-modes fp8_tensorwise; done
for i in a b; do launch torchao-$i python3 bench_fp8.py --train-modes torchao_tensorwise; done
wait
for f in /tmp/bf16-*.log /tmp/tw-*.log /tmp/torchao-*.log; do echo "== $(basename $f)"; grep -E "Error" $f | tail -2; done
cd $OUT && python3 $OLDPWD/bench_fp8.py --parts none --summarize $L-*.json
