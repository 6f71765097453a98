# Issue 7, one device call (from the repo root, the torchao wheel carried in .whl/). First the FP8 loss's
# gradient cast over 8 tiles, with its checks against torch (no dy, an all-zero dy, a random dy); then the reference
# step with drop_logits; then the 300-step loss runs on real text at a peak learning rate of 3e-4 (stop 36's
# second call: 1e-3 ends 6.8% higher in bf16 itself): bf16, ours and torchao in parallel processes, pooled by
# mode. Only the loss runs' files go to $OUT (a call returns 8); the rest is printed. LOSS_S: each loss
# process's time limit.
source benchmarks/gpu_setup.sh
cd benchmarks
D=$(date +%F)
A=/tmp/aux
mkdir -p $A
OUT=$A BENCH_NAME=$D-tune-grad-cast.json timeout 120 python3 tune_fp8_quantize.py --parts grad_cast > $A/tune.log 2>&1
echo "tune rc=$?"; tail -20 $A/tune.log
OUT=$A BENCH_NAME=$D-llama-step-drop.json timeout 130 python3 bench_llama_step.py --steps 20 --profile \
  --modes inductor_cg fusion_fp8_tensorwise_drop_cg > $A/step.log 2>&1
echo "step rc=$?"; grep -E "^\| (inductor|fusion)" $A/step.log; grep -E "_grad_cast|_cast_both|_amax_partial" $A/step.log
L=$D-fp8-lr3e-4
launch() {  # name, then the command's words
  local name=$1; shift
  TORCHINDUCTOR_COMPILE_THREADS=2 TORCHINDUCTOR_CACHE_DIR=/tmp/ic-$name BENCH_NAME=$L-$name.json \
    timeout ${LOSS_S:-250} "$@" --parts train --data text --layers 4 --repeats 2 --lr 3e-4 \
    --mode-prefix lr3e-4: > $A/$name.log 2>&1 &
}
for i in a b c; do launch bf16-$i python3 bench_fp8.py --train-modes bf16; done
for i in a b c; do launch tw-$i python3 bench_fp8.py --train-modes fp8_tensorwise; done
for i in a b; do launch torchao-$i python3 bench_fp8.py --train-modes torchao_tensorwise; done
wait
for f in $A/*.log; do echo "== $(basename $f)"; grep -E "Error" $f | tail -2; done
cd $OUT && python3 $OLDPWD/bench_fp8.py --parts none --summarize $L-*.json
