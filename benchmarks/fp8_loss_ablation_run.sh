# Issue 7, second device call of stop 36 (from the repo root). First the tiles of the FP8 loss's gradient cast
# (1.41 ms in the reference step, about twice the tensorwise cast's own kernel on the same shape); then the
# reference step with drop_logits again (the cast kernel's dy branch now compiled out when there is no dy);
# then which part of the tensorwise recipe costs the loss: 300-step runs on real text in parallel processes,
# pooled by mode, with the forward GEMM in bf16 (x and w both, x alone, w alone: fp8_variants.py), and bf16
# against ours at a third of the peak learning rate. Only the loss runs' files go to $OUT (8 come back);
# the rest is printed. LOSS_S: each loss process's time limit.
source benchmarks/gpu_setup.sh
cd benchmarks
D=$(date +%F)
A=/tmp/aux
mkdir -p $A
OUT=$A BENCH_NAME=$D-tune-grad-cast.json timeout 150 python3 tune_fp8_quantize.py --parts grad_cast > $A/tune.log 2>&1
echo "tune rc=$?"; tail -22 $A/tune.log
OUT=$A BENCH_NAME=$D-llama-step-drop.json timeout 130 python3 bench_llama_step.py --steps 20 --profile \
  --modes inductor_cg fusion_fp8_tensorwise_drop_cg > $A/step.log 2>&1
echo "step rc=$?"; grep -E "^\| (inductor|fusion)" $A/step.log; grep -E "_grad_cast|_cast_both|_amax_partial" $A/step.log
L=$D-fp8-ablate
launch() {  # name, then the command's words
  local name=$1; shift
  TORCHINDUCTOR_COMPILE_THREADS=2 TORCHINDUCTOR_CACHE_DIR=/tmp/ic-$name BENCH_NAME=$L-$name.json \
    timeout ${LOSS_S:-290} "$@" --parts train --data text --layers 4 --repeats 2 > $A/$name.log 2>&1 &
}
launch bf16 python3 bench_fp8.py --train-modes bf16
launch tw python3 bench_fp8.py --train-modes fp8_tensorwise
launch fwdbf16 python3 fp8_variants.py fwd_bf16 bench_fp8.py --train-modes fp8_tensorwise
launch xbf16 python3 fp8_variants.py x_bf16_fwd bench_fp8.py --train-modes fp8_tensorwise
launch wbf16 python3 fp8_variants.py w_bf16_fwd bench_fp8.py --train-modes fp8_tensorwise
launch lr-bf16 python3 bench_fp8.py --train-modes bf16 --lr 3e-4 --mode-prefix lr3e-4:
launch lr-tw-b python3 bench_fp8.py --train-modes fp8_tensorwise --lr 3e-4 --mode-prefix lr3e-4:
launch lr-tw-a python3 bench_fp8.py --train-modes fp8_tensorwise --lr 3e-4 --mode-prefix lr3e-4:
wait
for f in $A/*.log; do echo "== $(basename $f)"; grep -E "Error" $f | tail -2; done
cd $OUT && python3 $OLDPWD/bench_fp8.py --parts none --summarize $L-*.json
